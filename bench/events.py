#!/usr/bin/env python
"""Event-plane benchmark: wire size, codec speed, publish → apply over ZMQ and JetStream.

    python bench/events.py            # full run (about a minute)
    python bench/events.py --quick    # smaller counts, for a smoke check

Prints, side by side:

1. bytes per event (per block) of KVEvent v1 against vLLM's ``BlockStored`` encoding of the
   same blocks (array and map form; one event per block and one event per 16-block chain;
   vLLM sends the blocks' token ids, 16 tokens per block here);
2. encode and decode rates of KVEvent v1 batches on one core, and for reference a generic
   MessagePack decode of vLLM's array form and the full vLLM → KVEvent v1 adapter;
2b. ``BlockTracker.apply_batch`` on one core, ours against a reference tracker whose
   parent-cycle check walks one link at a time (the check before shortcuts): the stream of
   section 3 (Stores and Removes of chained blocks; no Store there needs the check), and
   a stream where every Store of a new block finds its child already held (the child came
   first) under a 4,096-block chain, so every such Store needs the check;
3. publish → apply throughput and p50 / p99 latency over ZMQ and over NATS JetStream on
   loopback: the publisher (validate, batch, encode, send) runs in this process, the
   subscriber in another one; "deliver" takes each batch from the subscriber's queue,
   "apply" also folds it into the SDK's
   ``BlockTracker`` (the stream alternates Stores and Removes of the same 1,024 blocks, so
   every event changes the tracker). Latency = apply time − the batch's ``ts_ns`` (flush time), measured
   at saturation and at a paced ~50,000 events/s. JetStream runs on a private
   ``nats-server -js`` on a free port (the shared server is not touched).

Goals printed beside the figures: ≤ 64 B/event; ≥ 1,000,000 events/s decode on one core;
≥ 300,000 events/s end to end through JetStream.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import msgspec  # noqa: E402

from bench._report import Report, add_json_option  # noqa: E402

from event_plane import (  # noqa: E402
    BlockTracker,
    EventBatch,
    JetStreamPublisher,
    JetStreamSubscriber,
    PublisherConfig,
    ZmqPublisher,
    ZmqSubscriber,
    decode_batch,
    encode_batch,
    remove,
    store,
)
from event_plane.adapters import vllm_config, vllm_converter  # noqa: E402
from event_plane.schema import PARENT_WALK_LIMIT  # noqa: E402
from event_plane.adapters.emit import peer_batch, peer_event  # noqa: E402

BLOCK_TOKENS = 16
BLOCK_BYTES = 64 * 1024
CHAIN = 16
BATCH_EVENTS = 1024


# ---------------------------------------------------------------------------- data
def make_chains(n_chains: int, rng: random.Random) -> list[list[tuple[int, list[int]]]]:
    """``n_chains`` chains of ``CHAIN`` blocks: (random u64 sequence hash, 16 token ids)."""
    return [
        [(rng.getrandbits(64), [rng.randrange(0, 150_000) for _ in range(BLOCK_TOKENS)]) for _ in range(CHAIN)]
        for _ in range(n_chains)
    ]


def our_events(chains: list[list[tuple[int, list[int]]]]) -> list[Any]:
    out = []
    for chain in chains:
        first = chain[0][0]
        parent = None
        for h, _ in chain:
            out.append(store(h, first, parent, BLOCK_BYTES, "g1"))
            parent = h
    return out


def vllm_events(chains: list[list[tuple[int, list[int]]]], form: str, per_chain: bool) -> list[Any]:
    out = []
    for chain in chains:
        groups = [chain] if per_chain else [[blk] for blk in chain]
        parent = None
        for group in groups:
            values = {
                "block_hashes": [h for h, _ in group],
                "parent_block_hash": parent,
                "token_ids": [t for _, toks in group for t in toks],
                "block_size": BLOCK_TOKENS,
                "lora_id": None,
                "medium": "GPU",
            }
            out.append(peer_event("BlockStored", values, flavor="vllm", form=form))  # type: ignore[arg-type]
            parent = group[-1][0]
    return out


def per_block_bytes(payloads: list[bytes], blocks: int) -> float:
    return sum(len(p) for p in payloads) / blocks


# ---------------------------------------------------------------------------- 1. size
def bench_size(chains: list[list[tuple[int, list[int]]]]) -> dict[str, float]:
    blocks = len(chains) * CHAIN
    evs = our_events(chains)
    ours = [encode_batch(EventBatch(1, "worker-0", 2**63 + 5, i, time.time_ns(), evs[i : i + BATCH_EVENTS]))
            for i in range(0, len(evs), BATCH_EVENTS)]
    out = {"KVEvent v1 (1 Store per block)": per_block_bytes(ours, blocks)}
    for form in ("array", "map"):
        for per_chain, label in ((False, "1 event per block"), (True, "1 event per 16-block chain")):
            vev = vllm_events(chains, form, per_chain)
            per = CHAIN if per_chain else 1
            step = max(1, BATCH_EVENTS // per)
            payloads = [peer_batch(vev[i : i + step], ts=time.time()) for i in range(0, len(vev), step)]
            out[f"vLLM BlockStored {form} form, {label}"] = per_block_bytes(payloads, blocks)
    return out


# ---------------------------------------------------------------------------- 2. codec
def rate(fn: Any, per_call: int, min_s: float) -> float:
    """Calls of ``fn`` per second × ``per_call``, over at least ``min_s`` seconds."""
    fn()
    n = 0
    t0 = time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return n * per_call / dt


def bench_codec(chains: list[list[tuple[int, list[int]]]], min_s: float) -> dict[str, float]:
    evs = our_events(chains)[:BATCH_EVENTS]
    batch = EventBatch(1, "worker-0", 2**63 + 5, 7, time.time_ns(), evs)
    payload = encode_batch(batch)
    vpayload = peer_batch(vllm_events(chains[: BATCH_EVENTS // CHAIN], "array", False), ts=time.time())
    conv = vllm_converter(vllm_config("bench", bytes_per_token=4096, epoch=1))
    generic = msgspec.msgpack.Decoder()
    return {
        "KVEvent v1 encode": rate(lambda: encode_batch(batch), len(evs), min_s),
        "KVEvent v1 decode (typed, validated)": rate(lambda: decode_batch(payload), len(evs), min_s),
        "vLLM array form: generic msgpack decode": rate(lambda: generic.decode(vpayload), BATCH_EVENTS, min_s),
        "vLLM array form -> KVEvent v1 (adapter)": rate(lambda: conv.convert(0, vpayload, live=False), BATCH_EVENTS, min_s),
    }


# ---------------------------------------------------------------------------- 2b. tracker
class WalkingTracker(BlockTracker):
    """Reference: the parent-cycle check one link at a time, up to PARENT_WALK_LIMIT."""

    def _closes_cycle(self, h: int, parent: int) -> bool:
        x: int | None = parent
        for _ in range(PARENT_WALK_LIMIT):
            block = self._blocks.get(x)  # type: ignore[arg-type]
            if block is None or block.parent_hash is None:
                return False
            x = block.parent_hash
            if x == h:
                return True
        return False


def tracker_streams(chains: list[list[tuple[int, list[int]]]], n_batches: int) -> dict[str, list[EventBatch]]:
    """The two streams of section 2b, ``n_batches`` batches each (after a set-up batch)."""
    stores = our_events(chains)[:BATCH_EVENTS]
    removes = [remove(e.sequence_hash, e.prefix_hash, e.parent_hash, e.block_size, e.storage_location) for e in stores]
    first = [EventBatch(1, "w", 1, i, 0, stores if i % 2 == 0 else removes) for i in range(n_batches)]
    long = [store(h, 1, h - 1 if h > 1 else None, 4096, "g1") for h in range(1, PARENT_WALK_LIMIT + 1)]
    late = [EventBatch(1, "w", 1, 0, 0, long)]
    for i in range(n_batches):
        evs = []
        for k in range(BATCH_EVENTS // 4):  # child first (an orphan), then its parent under the chain's end
            w = (1 << 40) + (i * BATCH_EVENTS + k) * 2
            evs += [store(w + 1, 1, w, 4096, "g1"), store(w, 1, PARENT_WALK_LIMIT, 4096, "g1")]
        evs += [remove(e.sequence_hash, 1, e.parent_hash, 4096, "g1") for e in reversed(evs)]  # leaves first
        late.append(EventBatch(1, "w", 1, i + 1, 0, evs))
    return {"Store/Remove of chains (section 3's stream)": first,
            "child first, then parent under a 4,096-block chain": late}


def bench_tracker(chains: list[list[tuple[int, list[int]]]], n_batches: int) -> dict[str, tuple[float, float]]:
    """Events/s of ours and of :class:`WalkingTracker` per stream (best of 5 runs each,
    the two run alternately so that both see the same machine load)."""
    out = {}
    for label, batches in tracker_streams(chains, n_batches).items():
        n = sum(len(b.events) for b in batches)
        best = {BlockTracker: 0.0, WalkingTracker: 0.0}
        for _ in range(5):
            for cls in best:
                tr = cls()
                t0 = time.perf_counter()
                for b in batches:
                    tr.apply_batch(b)
                best[cls] = max(best[cls], n / (time.perf_counter() - t0))
        out[label] = (best[BlockTracker], best[WalkingTracker])
    return out


# ---------------------------------------------------------------------------- 3. end to end
def _subscriber_main(kind: str, target: str, namespace: str, total: int, apply: bool, conn: Any) -> None:
    """Child process: subscribe, take every batch (and fold it into a BlockTracker when
    ``apply``), report timings."""
    if kind == "zmq":
        pub_ep, rep_ep = target.split("|")
        sub: Any = ZmqSubscriber([(pub_ep, rep_ep)], queue_capacity=1_000_000)
    else:
        sub = JetStreamSubscriber(target, namespace, durable="bench" + secrets.token_hex(3), batch_size=512,
                                  queue_capacity=1_000_000)
    sub.start()
    if kind == "zmq":
        time.sleep(0.5)  # slow joiner
    conn.send("ready")
    tracker = BlockTracker()
    got = 0
    lat_ns: list[int] = []
    first = last = 0
    while got < total:
        batch = sub.get(timeout=15.0)
        if batch is None:
            break
        if apply:
            tracker.apply_batch(batch)
        now = time.time_ns()
        if not got:
            first = now
        last = now
        got += len(batch.events)
        lat_ns.append(now - batch.ts_ns)
    st = sub.stats()
    sub.close()
    conn.send({"events": got, "first_ns": first, "last_ns": last, "lat_ns": lat_ns, "gaps": st.gaps,
               "dropped": st.dropped, "unrecovered": st.unrecovered, "tracked": len(tracker)})


def run_e2e(kind: str, total: int, paced: bool, apply: bool, nats_url: str | None) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    namespace = "bench" + secrets.token_hex(3)
    if kind == "zmq":
        from storage_backends.local_s3 import free_port

        pub_ep, rep_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        target = f"{pub_ep}|{rep_ep}"
    else:
        assert nats_url is not None
        target = nats_url
    cfg = PublisherConfig(max_events=BATCH_EVENTS, max_bytes=1 << 22, replay_buffer=1000, queue_capacity=1 << 22,
                          overflow="block", max_delay_s=0.05 if paced else 10.0)
    # the publisher exists (and, for JetStream, the stream) before the subscriber starts
    pub: Any = (ZmqPublisher("worker-0", pub_ep, rep_ep, config=cfg) if kind == "zmq"
                else JetStreamPublisher("worker-0", target, namespace, config=cfg, manage_stream=True))
    proc = ctx.Process(target=_subscriber_main, args=(kind, target, namespace, total, apply, child))
    proc.start()
    try:
        if not parent.poll(30) or parent.recv() != "ready":
            raise RuntimeError(f"{kind} subscriber did not start")
        chains = make_chains(BATCH_EVENTS // CHAIN, random.Random(7))
        stores = our_events(chains)
        # Store then Remove the same blocks, alternately: the tracker does real work on every
        # event (insert, link, delete) and its size stays bounded.
        removes = [remove(e.sequence_hash, e.prefix_hash, e.parent_hash, e.block_size, e.storage_location) for e in stores]
        chunk = 64 if paced else BATCH_EVENTS
        groups = BATCH_EVENTS // chunk
        sent = j = 0
        t0 = time.time_ns()
        next_at = time.perf_counter()
        while sent < total:
            n = min(chunk, total - sent)
            g = (j // 2) % groups
            pub.publish((stores if j % 2 == 0 else removes)[g * chunk : g * chunk + n])
            j += 1
            sent += n
            if paced:  # ~50,000 events/s: 64 events every 1.28 ms
                next_at += chunk / 50_000
                delay = next_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
        pub.flush()
        if not parent.poll(60):
            raise RuntimeError(f"{kind} subscriber did not finish")
        res = parent.recv()
    finally:
        pub.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    lat = sorted(res["lat_ns"]) or [0]
    elapsed = max(res["last_ns"] - t0, 1) / 1e9
    return {
        "events": res["events"],
        "events_per_s": res["events"] / elapsed,
        "p50_ms": lat[len(lat) // 2] / 1e6,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] / 1e6,
        "lost": total - res["events"] + res["dropped"] + res["unrecovered"],
    }


# ---------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description="event-plane benchmark")
    parser.add_argument("--quick", action="store_true", help="small counts (smoke check)")
    add_json_option(parser)
    args = parser.parse_args()
    report = Report("events", "event plane: wire size, codec, publish -> apply over ZMQ and NATS JetStream")
    total = 100_000 if args.quick else 1_000_000
    min_s = 0.2 if args.quick else 1.0
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    print(f"# event plane benchmark  (python {sys.version.split()[0]}, {os.cpu_count()} CPUs, msgspec {msgspec.__version__})")
    rng = random.Random(1)
    chains = make_chains(1024, rng)

    print("\n## 1. Wire size: bytes per block (16,384 blocks: random u64 hashes, 64 KiB, g1; "
          f"batches of up to {BATCH_EVENTS} blocks, envelope included)")
    sizes = bench_size(chains)
    ours = sizes["KVEvent v1 (1 Store per block)"]
    print(f"{'encoding':58s} {'B/block':>8s} {'vs ours':>8s}")
    for label, value in sizes.items():
        print(f"{label:58s} {value:8.2f} {value / ours:7.2f}x")
    print(f"goal: <= 64 B/event   -> {'MET' if ours <= 64 else 'MISSED'} ({ours:.2f})")
    vllm_form = "vLLM BlockStored array form, 1 event per block"
    report.add("wire size, KVEvent v1, 1 Store per block", ours, sizes[vllm_form], unit="B/block",
               reference_name=vllm_form, goal="<= 64",
               met=ours <= 64, better="lower")

    print(f"\n## 2. Codec, one core (batches of {BATCH_EVENTS} events)")
    codec = bench_codec(chains, min_s)
    for label, value in codec.items():
        print(f"{label:58s} {value / 1e6:8.2f} M events/s")
    dec = codec["KVEvent v1 decode (typed, validated)"]
    print(f"goal: >= 1,000,000 events/s decode -> {'MET' if dec >= 1e6 else 'MISSED'} ({dec / 1e6:.2f} M/s)")
    report.add("KVEvent v1 decode (typed, validated), one core", dec, codec["vLLM array form: generic msgpack decode"],
               unit="events/s", reference_name="generic MessagePack decode of vLLM's array form",
               goal=">= 1,000,000", met=dec >= 1e6)
    report.add("KVEvent v1 encode, one core", codec["KVEvent v1 encode"], unit="events/s")

    print("\n## 2b. BlockTracker apply, one core: ours vs a one-link-at-a-time cycle check")
    print(f"{'stream':58s} {'ours ev/s':>12s} {'reference':>12s} {'ratio':>7s}")
    for label, (ours_r, ref_r) in bench_tracker(chains, 20 if args.quick else 100).items():
        print(f"{label:58s} {ours_r:12,.0f} {ref_r:12,.0f} {ours_r / ref_r:6.2f}x")
        report.add(f"BlockTracker apply: {label}", ours_r, ref_r, unit="events/s",
                   reference_name="cycle check walking one link at a time")

    print(f"\n## 3. Publish -> apply (BlockTracker in a second process), loopback, {total:,} events")
    exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
    nats_proc = None
    results: dict[str, dict[str, float]] = {}
    try:
        from conftest import start_nats_server

        if os.path.exists(exe):
            nats_proc, nats_url, _ = start_nats_server()
        else:
            nats_url = None
        print(f"{'transport':44s} {'events/s':>12s} {'p50 ms':>9s} {'p99 ms':>9s} {'lost':>6s}")
        kinds = ["zmq", "jetstream"] if nats_url else ["zmq"]
        for kind in kinds:
            for paced, apply in ((False, False), (False, True), (True, True)):
                n = min(total, 50_000 if args.quick else 100_000) if paced else total
                r = run_e2e(kind, n, paced, apply, nats_url)
                name = "ZMQ" if kind == "zmq" else "NATS JetStream"
                label = f"{name} {'paced 50k ev/s' if paced else 'saturated'}, {'apply' if apply else 'deliver'}"
                results[label] = r
                print(f"{label:44s} {r['events_per_s']:12,.0f} {r['p50_ms']:9.2f} {r['p99_ms']:9.2f} {int(r['lost']):6d}")
                js_goal = kind == "jetstream" and not paced
                report.add(f"{label}, events/s", r["events_per_s"], unit="events/s",
                           goal=">= 300,000" if js_goal else "",
                           met=r["events_per_s"] >= 300_000 if js_goal else None,
                           headline=js_goal and apply)
                report.add(f"{label}, p99 latency", r["p99_ms"], unit="ms", better="lower")
    finally:
        if nats_proc is not None:
            nats_proc.terminate()
            nats_proc.wait(10)
    for mode in ("deliver", "apply"):
        js = results.get(f"NATS JetStream saturated, {mode}")
        if js is not None:
            ok = js["events_per_s"] >= 300_000
            print(f"goal: >= 300,000 events/s end to end through JetStream ({mode}) -> {'MET' if ok else 'MISSED'} "
                  f"({js['events_per_s']:,.0f}/s)")
    report.extra = {"sizes_b_per_block": sizes, "codec_events_per_s": codec, "e2e": results}
    report.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
