"""vLLM / SGLang adapters on real ZMQ sockets: our own emitter speaks their exact shapes
(array and map events, signed hashes, digests, both replay reply shapes) and the adapter
subscriber yields KVEvent v1 batches in seq order, recovering lost batches by replay."""

from __future__ import annotations

import hashlib
import time

import pytest

from event_plane import EventType, subscribe
from event_plane.adapters import PeerEmitter, hash_to_u64
from event_plane.adapters.emit import peer_batch
from storage_backends.local_s3 import free_port

S, R, C = EventType.STORE, EventType.REMOVE, EventType.CLEARED


def rows(batches) -> list[tuple]:  # type: ignore[no-untyped-def]
    return [(b.seq, e.type, e.sequence_hash, e.prefix_hash, e.parent_hash, e.block_size, e.storage_location)
            for b in batches for e in b.events]


CASES = [
    # flavor, form, reply_topic, legacy, hashes of a 3-block chain
    pytest.param("vllm", "map", True, False, [2**63 + 1, 2**64 - 2, 7], id="vllm-0.26-map-topic-replies"),
    pytest.param("vllm", "array", False, True, [11, 12, 13], id="vllm-old-array-no-medium"),
    pytest.param("sglang", "array", False, False, [-3, -(2**63), 5], id="sglang-array-signed"),
    pytest.param("sglang", "map", False, False, [-7, 8, -9], id="sglang-map-signed"),
]


@pytest.mark.parametrize(("flavor", "form", "reply_topic", "legacy", "hashes"), CASES)
def test_late_join_gap_replay_and_mapping(flavor: str, form: str, reply_topic: bool, legacy: bool, hashes: list[int]) -> None:
    port, rport = free_port(), free_port()
    em = PeerEmitter(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", flavor=flavor, form=form,  # type: ignore[arg-type]
                     topic=b"kv@pod-a", reply_topic=reply_topic, legacy=legacy)
    u = [hash_to_u64(h) for h in hashes]
    medium = None if legacy else "GPU"
    try:
        em.send([em.stored(hashes[:2], None, block_size=16, medium=medium)], dp_rank=0)  # seq 0, before anyone listens
        sub = subscribe(f"{flavor}+zmq://127.0.0.1:{port}?replay={rport}&source=pod-a&bytes_per_token=1024&topic=kv@pod-a")
        sub.start()
        time.sleep(0.3)
        try:
            em.send_payload(peer_batch([em.stored(hashes[2:], hashes[1], block_size=16, medium=medium)]), live=False)  # seq 1 lost live
            em.send([em.removed(hashes[:1], medium=medium), em.cleared()])  # seq 2
            got = sub.get_many(3, 5.0)
            size = 16 * 1024
            assert rows(got) == [
                (0, S, u[0], u[0], None, size, "g1"),
                (0, S, u[1], u[0], u[0], size, "g1"),
                (1, S, u[2], u[0], u[1], size, "g1"),
                (2, R, u[0], u[0], None, size, "g1"),
                (2, C, 0, 0, None, 0, "g1"),
            ]
            assert {(b.source, b.version) for b in got} == {("pod-a", 1)} and len({b.epoch for b in got}) == 1
            st = sub.stats()
            assert (st.gaps, st.replayed, st.unrecovered, st.decode_errors) == (1, 2, 0, 0)
        finally:
            sub.close()
    finally:
        em.close()


def test_vllm_raw_digests_and_peer_restart_gets_a_new_epoch() -> None:
    port, rport = free_port(), free_port()
    em = PeerEmitter(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", flavor="vllm", form="array")
    digests = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    as_int = [int.from_bytes(d, "big") & (2**64 - 1) for d in digests]  # what vLLM's int mode sends
    sub = subscribe(f"vllm+zmq://127.0.0.1:{port}?replay={rport}&source=pod-b")
    sub.start()
    time.sleep(0.3)
    try:
        em.send([em.stored(digests, None, medium="CPU")])
        em.send([em.stored([as_int[2] ^ 1], as_int[2], medium="CPU")])  # int form continues the chain
        first = sub.get_many(2, 5.0)
        assert [e.sequence_hash for b in first for e in b.events] == [*as_int, as_int[2] ^ 1]
        assert first[1].events[0].prefix_hash == as_int[0] and first[1].events[0].storage_location == "g2"
        em.restart()  # the vLLM process restarted: seq 0 again, nothing in its frames says so
        em.send([em.stored([99], None)])
        em.send([em.stored([100], 99)])
        second = sub.get_many(2, 5.0)
        assert [b.seq for b in second] == [0, 1]
        assert second[0].epoch != first[0].epoch and second[1].epoch == second[0].epoch
        st = sub.stats()
        assert (st.restarts, st.duplicates, st.unrecovered) == (1, 0, 0)
        assert sub.peer_stats().restarts == 1  # type: ignore[attr-defined]
    finally:
        sub.close()
        em.close()


def test_vllm_offload_event_without_parent_keeps_the_recorded_chain() -> None:
    """vLLM's offloading connector publishes ``BlockStored`` with medium ``CPU`` and
    ``parent_block_hash=None`` for blocks it first announced on ``GPU``: the adapter keeps
    the parent and prefix it recorded, on real sockets."""
    port = free_port()
    em = PeerEmitter(f"tcp://127.0.0.1:{port}", None, flavor="vllm", form="array")
    sub = subscribe(f"vllm+zmq://127.0.0.1:{port}?source=pod-c&bytes_per_token=2")
    sub.start()
    time.sleep(0.3)
    try:
        em.send([em.stored([501, 502], None, block_size=16, medium="GPU")])
        em.send([em.stored([502], None, block_size=16, medium="CPU")])  # offloaded to host
        em.send([em.removed([502], medium="GPU")])
        got = sub.get_many(3, 5.0)
        assert rows(got) == [
            (0, S, 501, 501, None, 32, "g1"),
            (0, S, 502, 501, 501, 32, "g1"),
            (1, S, 502, 501, 501, 32, "g2"),
            (2, R, 502, 501, 501, 32, "g1"),
        ]
    finally:
        sub.close()
        em.close()
