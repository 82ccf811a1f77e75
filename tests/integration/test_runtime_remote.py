"""Remote blocks through NIXL UCX: a decode worker reads a prefill worker's G2 (one
process with two agents, and two processes exchanging the export over a real ZMQ socket)."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest
import torch
import zmq

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from event_plane import KVEvent, NullPublisher  # noqa: E402
from kvbm_runtime import BlockManager, RuntimeConfig, fill_synthetic_kv, synthetic_block_bytes  # noqa: E402
from kvbm_runtime.remote import BlockExport, RemoteBlockError, RemoteExporter, RemoteReader  # noqa: E402

PAGE = 4


def config(**kw: object) -> RuntimeConfig:
    base: dict[str, object] = {
        "model_name": "it/remote",
        "page_size": PAGE,
        "inner_dim": 16,
        "g1_blocks": 16,
        "g2_blocks": 32,
    }
    base.update(kw)
    return RuntimeConfig(**base)  # type: ignore[arg-type]


def expected(mgr: BlockManager, h: int) -> torch.Tensor:
    return synthetic_block_bytes(h, mgr.layout_config.block_shape, mgr.layout_config.dtype)


class Capture:
    def __init__(self, source: str) -> None:
        self.batches: list[list[KVEvent]] = []
        self.publisher = NullPublisher(source, on_flush=lambda b, _p: self.batches.append(list(b.events)))

    def events(self) -> list[tuple[str, int, str]]:
        self.publisher.flush()
        return [(e.type.name, e.sequence_hash, e.storage_location) for b in self.batches for e in b]


@pytest.mark.parametrize(("src_layout", "dst_layout"), [("FullyContiguous", "FullyContiguous"), ("LayerSeparated", "FullyContiguous")])
def test_decode_worker_onboards_prefill_blocks_in_one_process(src_layout: str, dst_layout: str) -> None:
    prefill = BlockManager(config(layout=src_layout), NullPublisher("prefill"))
    tokens = list(range(1, 22))  # 5 full blocks
    hs = prefill.serve(tokens, fill_synthetic_kv).sequence_hashes
    exporter = RemoteExporter(prefill.g2)
    cap = Capture("decode")
    # the layouts may differ in kind: bytes are read page by page, and the decode side
    # registers the prefill side's identities as they are
    decode = BlockManager(config(layout=dst_layout), cap.publisher)
    reader = RemoteReader(decode.g1)
    try:
        export = exporter.export(hs[:3] + [12345] + hs[3:])  # stops at the first miss
        assert [b.sequence_hash for b in export.blocks] == hs[:3]
        assert prefill.g2.stats().active == 3  # pinned while the reader works
        handles = reader.onboard(export)
        assert [h.sequence_hash for h in handles] == hs[:3]
        for h in handles:
            assert torch.equal(decode.g1.layout.read_bytes(h.block_id), expected(prefill, h.sequence_hash))
            h.release()
        assert cap.events() == [("STORE", h, "g1") for h in hs[:3]]
        # already resident: nothing read again, the existing blocks are returned
        again = reader.onboard(export)
        assert reader.bytes_read == 3 * decode.block_bytes and [h.sequence_hash for h in again] == hs[:3]
        for h in again:
            h.release()
        assert exporter.release(export.lease) == 3 and prefill.g2.stats().active == 0
    finally:
        reader.close()
        exporter.close()


def test_geometry_mismatch_and_bad_messages_are_refused() -> None:
    prefill = BlockManager(config(), NullPublisher("prefill"))
    hs = prefill.serve(list(range(1, 9)), fill_synthetic_kv).sequence_hashes
    exporter = RemoteExporter(prefill.g2)
    decode = BlockManager(config(inner_dim=32), NullPublisher("decode"))
    reader = RemoteReader(decode.g1)
    try:
        export = exporter.export(hs)
        with pytest.raises(RemoteBlockError, match="does not match local"):
            reader.onboard(export)
        assert decode.g1.stats().reset == 16  # nothing allocated or registered
        with pytest.raises(RemoteBlockError, match="malformed block export"):
            BlockExport.from_bytes(b"\x93garbage")
    finally:
        reader.close()
        exporter.close()


def test_decode_worker_reads_a_prefill_process_over_zmq() -> None:
    tokens = list(range(100, 117))  # 4 full blocks
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbm_runtime.testing.remote_peer", "--tokens", ",".join(map(str, tokens))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NIXL_LOG_LEVEL": "WARN"},
    )
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("PORT "), (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        sock.connect(f"tcp://127.0.0.1:{int(line.split()[1])}")
        decode = BlockManager(config(), NullPublisher("decode-proc"))
        reader = RemoteReader(decode.g1)
        hs = decode.sequence_hashes(tokens)
        sock.send(msgspec.msgpack.encode(["export", hs]))
        export = BlockExport.from_bytes(sock.recv())
        assert [b.sequence_hash for b in export.blocks] == hs
        handles = reader.onboard(export)
        for h in handles:
            assert torch.equal(decode.g1.layout.read_bytes(h.block_id), expected(decode, h.sequence_hash))
            h.release()
        sock.send(msgspec.msgpack.encode(["release", export.lease]))
        assert msgspec.msgpack.decode(sock.recv()) == 4
        # the decode worker now serves the prompt from G1 without computing anything
        r = decode.serve(tokens, fill_synthetic_kv)
        assert (r.hits_g1, r.computed) == (4, 0)
        sock.send(msgspec.msgpack.encode(["stop"]))
        assert msgspec.msgpack.decode(sock.recv()) == "ok"
        assert proc.wait(timeout=30) == 0
        reader.close()
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
