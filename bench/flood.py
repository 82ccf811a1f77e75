"""Floods against a real advisor: does a well-behaved publisher stay indexed within 1 s?

One advisor process (``python -m advisor``: SQLite journal, REST API, default quotas)
subscribes to two ZMQ publishers: a well-behaved one (``good``, in this process) and a
hostile one (a child process: a bare PUB socket that sends whatever it is told). The
floods of docs/security.md ("Flood bounds") run in turn, at ``--scale`` of full size:

- ``registrations``: 2,000 ``POST /register`` to a dead loopback port;
- ``epochs``: 200,000 empty batches of one source, each a new epoch;
- ``sources``: 50,000 source names, one Store each;
- ``message``: one 64 MB message (not scaled).

Meanwhile the good publisher publishes one Store every ``--interval-ms`` and polls
``GET /v1/blocks/{hash}`` until the advisor holds it: the time from publish to indexed is
its index latency. Each row prints that latency's p50 / p99 / max during the flood (and
``--tail-s`` after it was sent) beside the same figures with no flood, and the advisor's
peak RSS (``VmHWM``, reset after start) against the documented bound.

When a good batch is still not indexed after the 1 s goal, the bench asks the advisor for its
threads' stacks (SIGUSR1, :func:`advisor.embedded.stacks.dump_stacks`) and takes its own
(the prober's side), at most :data:`MAX_STALL_DUMPS` times a run: :attr:`Result.stalls` keeps
them and :func:`table` prints them, so a slow batch names where it waited.

Run: ``python bench/flood.py [--scale 1.0] [--json out.json]`` (``make flood``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from advisor.embedded.stacks import dump_stacks  # noqa: E402
from bench._report import Report, add_json_option  # noqa: E402

FULL = {"registrations": 2000, "epochs": 200_000, "sources": 50_000}
MESSAGE_BYTES = 64 << 20
LATENCY_GOAL_S = 1.0
"""The product's promise: a well-behaved publisher's batch is indexed within this, flood or not."""
RSS_BOUND = 640 << 20
"""The advisor's peak RSS over all floods at full scale, default quotas (docs/security.md,
"Flood bounds"): what the quotas let the floods make it hold, plus the process itself."""
BS = 4096
MAX_STALL_DUMPS = 3
"""Stack dumps taken per run, at most (each is the advisor's and the prober's threads)."""


# ---------------------------------------------------------------- the hostile child
def hostile_main(url_port: int) -> None:
    """A bare PUB socket bound on ``url_port``; one command per stdin line, ``done`` after each:
    ``probe SEQ``, ``epochs N``, ``sources N``, ``message BYTES``, ``register N API_URL``."""
    import httpx
    import zmq

    from event_plane.codec import encode_batch
    from event_plane.frames import seq_to_bytes
    from event_plane.schema import WIRE_VERSION, EventBatch, store
    from storage_backends.local_s3 import free_port

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{url_port}")

    def send(b: EventBatch) -> None:
        sock.send_multipart([b"", seq_to_bytes(b.seq), encode_batch(b)])

    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "probe":
            send(EventBatch(WIRE_VERSION, "probe", 1, int(args[0]), 1, [store(7, 7, None, BS, "g1")]))
        elif cmd == "epochs":
            for e in range(int(args[0])):
                send(EventBatch(WIRE_VERSION, "churn", 1_000_000 + e, 0, 1, []))
        elif cmd == "sources":
            for s in range(int(args[0])):
                send(EventBatch(WIRE_VERSION, f"name-{s}", 1, 0, 1, [store(10 + s, 10 + s, None, BS, "g1")]))
        elif cmd == "message":
            sock.send_multipart([b"", seq_to_bytes(0), bytes(int(args[0]))], copy=False)
        elif cmd == "register":
            dead = f"tcp://127.0.0.1:{free_port()}"
            with httpx.Client(base_url=args[1], timeout=60) as c:
                codes: dict[int, int] = {}
                for k in range(int(args[0])):
                    code = c.post("/register", json={"instance_id": k, "endpoint": dead, "model_name": "m",
                                                     "block_size": 32}).status_code
                    codes[code] = codes.get(code, 0) + 1
            print(json.dumps(codes), flush=True)
        print("done", flush=True)
    sock.close(linger=0)
    ctx.term()


# ---------------------------------------------------------------- the bench
@dataclass
class Row:
    flood: str
    size: int
    sent_s: float
    samples: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    base_p50_ms: float
    base_p99_ms: float
    peak_rss_mib: float
    note: str = ""


@dataclass
class Result:
    scale: float
    rows: list[Row] = field(default_factory=list)
    base_rss_mib: float = 0.0
    peak_rss_mib: float = 0.0
    rss_bound_mib: float = RSS_BOUND / (1 << 20)
    unindexed: int = 0
    """Good batches never seen indexed (within 30 s each)."""
    sources: int = 0
    """Sources the advisor knows at the end (``GET /v1/stats``)."""
    counters: dict[str, int] = field(default_factory=dict)
    """The advisor's ingest counters at the end (quota refusals, drops...)."""
    dropped: int = 0
    """Batches its subscriber dropped (a source's or an origin's queue full) at the end."""
    stalls: list[str] = field(default_factory=list)
    """Per good batch past the 1 s goal (at most :data:`MAX_STALL_DUMPS`): the flood, how
    long it had waited, the advisor's thread stacks and the prober's."""


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} for {pid}")


class Prober:
    """The well-behaved publisher: one Store every ``interval_s``, then poll the API until
    it is indexed; keeps each latency (seconds) with its publish time."""

    def __init__(self, url: str, api: str, interval_s: float,
                 on_stall: Callable[[float], None] | None = None) -> None:
        import httpx

        from event_plane import PublisherConfig, make_publisher

        self.pub = make_publisher(url, "good", config=PublisherConfig(max_events=1, max_delay_s=0.01), epoch=1)
        self.http = httpx.Client(base_url=api, timeout=30)
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self.unindexed = 0
        self._h = 1 << 40
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._outstanding: float | None = None  # publish time of the batch being waited for
        self._on_stall = on_stall
        self._closed = threading.Event()
        self._watch = threading.Thread(target=self._watchdog, name="flood-watchdog", daemon=True)
        self._watch.start()

    def _watchdog(self) -> None:
        """Call ``on_stall(waited_s)`` once per batch that is past the goal."""
        reported: float | None = None
        while not self._closed.wait(0.05):
            t0 = self._outstanding
            if self._on_stall is not None and t0 is not None and t0 != reported:
                waited = time.monotonic() - t0
                if waited > LATENCY_GOAL_S:
                    reported = t0
                    self._on_stall(waited)

    def one(self, deadline_s: float = 30.0) -> float | None:
        """Publish one Store and wait until it is indexed; its latency (None: not within ``deadline_s``)."""
        from event_plane.schema import store

        self._h += 1
        h = self._h
        t0 = time.monotonic()
        self._outstanding = t0
        try:
            self.pub.publish([store(h, h, None, BS, "g1")])
            while time.monotonic() - t0 < deadline_s:
                if self.http.get(f"/v1/blocks/{h}").status_code == 200:
                    lat = time.monotonic() - t0
                    self.samples.append((t0, lat))
                    return lat
                time.sleep(0.002)
            self.unindexed += 1
            return None
        finally:
            self._outstanding = None

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.one()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="flood-prober", daemon=True)
        self._thread.start()

    def stop(self) -> list[float]:
        """Stop; the latencies (seconds) measured since :meth:`start`."""
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        return [lat for _, lat in self.samples]

    def close(self) -> None:
        self._closed.set()
        self._watch.join()
        self.pub.close()
        self.http.close()


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0] * 1000
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] * 1000 if q < 100 else max(xs) * 1000


def run(scale: float = 1.0, *, interval_s: float = 0.05, tail_s: float = 2.0, base_s: float = 2.0,
        workdir: str | None = None, log: bool = True, advisor_root: Path = ROOT) -> Result:
    """Run the floods in turn against a fresh advisor process at ``scale`` of full size
    (the advisor runs the code of ``advisor_root``: another checkout, to compare).

    Returns:
        The rows (one per flood) and RSS figures; :attr:`Result.unindexed` counts good
        batches not indexed within 30 s.
    """
    from storage_backends.local_s3 import free_port

    tmp = tempfile.TemporaryDirectory(prefix="kvadvisor-flood-", dir=workdir)
    bad_port, good_port, replay_port, api_port = free_port(), free_port(), free_port(), free_port()
    good_url = f"zmq://127.0.0.1:{good_port}?replay={replay_port}"
    cfg = {"journal_path": f"{tmp.name}/journal.sqlite", "subscribe_urls": [f"zmq://127.0.0.1:{bad_port}", good_url],
           "api_enabled": True, "api_port": api_port, "snapshot_store": "none", "policy_interval_s": 0}
    Path(tmp.name, "advisor.json").write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
    adv_log = open(Path(tmp.name, "advisor.stderr"), "w+")  # noqa: SIM115 - closed in finally
    adv = subprocess.Popen([sys.executable, "-m", "advisor", "--config", f"{tmp.name}/advisor.json"],
                           cwd=advisor_root, env={**env, "PYTHONPATH": str(advisor_root)}, stdout=subprocess.PIPE,
                           stderr=adv_log, text=True)
    bad = subprocess.Popen([sys.executable, __file__, "--hostile", str(bad_port)], cwd=ROOT, env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    prober = None
    res = Result(scale)
    flood_now = ["start"]

    def on_stall(waited_s: float) -> None:
        """The advisor's stacks (SIGUSR1 → its stderr) and this process's, for one slow batch."""
        if len(res.stalls) >= MAX_STALL_DUMPS:
            return
        at = adv_log.seek(0, io.SEEK_END)
        adv.send_signal(signal.SIGUSR1)
        mine = io.StringIO()
        dump_stacks(mine)
        deadline = time.monotonic() + 10  # the advisor writes its dump when its main thread runs
        while True:
            adv_log.seek(at)
            theirs = adv_log.read()
            if "=== end of stacks" in theirs or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        res.stalls.append(f"--- {flood_now[0]}: a good batch not indexed after {waited_s:.2f} s\n"
                          f"advisor (python -m advisor), stderr since:\n{theirs[-20000:]}\n"
                          f"prober (this process):\n{mine.getvalue()[-20000:]}")

    def say(*words: str) -> None:
        assert bad.stdin is not None
        bad.stdin.write(" ".join(words) + "\n")
        bad.stdin.flush()

    def answer() -> str:
        assert bad.stdout is not None
        out = ""
        while (line := bad.stdout.readline().strip()) != "done":
            if not line:
                raise RuntimeError("the hostile child exited")
            out = line
        return out

    try:
        assert adv.stdout is not None and bad.stdout is not None
        line = adv.stdout.readline().split()
        if line[:2] != ["ADVISOR", "READY"]:
            adv_log.seek(0)
            raise RuntimeError(f"advisor did not start: {line}; its stderr: {adv_log.read()[-4000:]}")
        api = line[2]
        assert bad.stdout.readline().strip() == "ready"
        prober = Prober(good_url, api, interval_s, on_stall)
        deadline = time.monotonic() + 60
        while prober.one(deadline_s=0.5) is None:  # the SUBs join late: a PUB drops what came before
            if time.monotonic() > deadline:
                raise RuntimeError("the good publisher never got through")
        seq = 0
        while prober.http.get("/v1/blocks/7").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the hostile publisher never got through")
            say("probe", str(seq))
            answer()
            seq += 1
            time.sleep(0.1)
        prober.samples.clear()
        prober.unindexed = 0
        res.stalls.clear()  # the SUBs joining late are not stalls
        flood_now[0] = "no flood"
        Path(f"/proc/{adv.pid}/clear_refs").write_text("5")
        res.base_rss_mib = _status(adv.pid, "VmHWM") / (1 << 20)
        prober.start()
        time.sleep(base_s)
        base = prober.stop()
        b50, b99 = _pct(base, 50), _pct(base, 99)
        floods = [("registrations", int(FULL["registrations"] * scale), ["register", None, api]),
                  ("epochs", int(FULL["epochs"] * scale), ["epochs", None]),
                  ("sources", int(FULL["sources"] * scale), ["sources", None]),
                  ("message", MESSAGE_BYTES, ["message", str(MESSAGE_BYTES)])]
        for name, size, cmd in floods:
            cmd = [str(size) if a is None else a for a in cmd]
            flood_now[0] = name
            prober.samples.clear()
            prober.start()
            t0 = time.monotonic()
            say(*cmd)
            note = answer()
            sent = time.monotonic() - t0
            time.sleep(tail_s)
            lats = prober.stop()
            row = Row(name, size, round(sent, 2), len(lats), round(_pct(lats, 50), 1), round(_pct(lats, 99), 1),
                      round(_pct(lats, 100), 1), round(b50, 1), round(b99, 1),
                      round(_status(adv.pid, "VmHWM") / (1 << 20), 1), note)
            res.rows.append(row)
            if log:
                print(f"  {name}: {row}", file=sys.stderr, flush=True)
        res.unindexed = prober.unindexed
        res.peak_rss_mib = _status(adv.pid, "VmHWM") / (1 << 20)
        stats = prober.http.get("/v1/stats").json()
        res.sources = len(stats["sources"])
        res.counters = {k: v for k, v in stats["ingest"].items() if isinstance(v, int)}
        res.dropped = int(stats.get("subscriber", {}).get("dropped", 0))
        return res
    finally:
        if prober is not None:
            prober.close()
        if bad.stdin is not None:
            bad.stdin.close()
        bad.wait(timeout=30)
        adv.terminate()
        try:
            adv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            adv.kill()
            adv.wait()
        adv_log.close()
        tmp.cleanup()


def table(res: Result) -> str:
    """The rows side by side: index latency during each flood vs without, and peak RSS vs bound."""
    head = (f"flood (scale {res.scale:g})  size        sent s  n    p50 ms  p99 ms  max ms  | no flood p50  p99  "
            f"| p99/goal  | peak RSS MiB (bound {res.rss_bound_mib:.0f})")
    out = [head, "-" * len(head)]
    for r in res.rows:
        out.append(f"{r.flood:<23}{r.size:<12}{r.sent_s:<8}{r.samples:<5}{r.p50_ms:<8}{r.p99_ms:<8}{r.max_ms:<8}"
                   f"| {r.base_p50_ms:<12} {r.base_p99_ms:<5}| {r.p99_ms / (LATENCY_GOAL_S * 1000):<9.3f} "
                   f"| {r.peak_rss_mib}  {r.note}")
    out.append(f"advisor RSS: {res.base_rss_mib:.0f} MiB after start, peak {res.peak_rss_mib:.0f} MiB "
               f"(bound {res.rss_bound_mib:.0f} MiB); good batches not indexed: {res.unindexed}; sources known "
               f"{res.sources}, refused by the source quota {res.counters.get('quota_refused_batches_sources', 0)}, "
               f"dropped on full queues {res.dropped}")
    if res.counters.get("journal_failures"):
        out.append(f"journal appends failed (retried): {res.counters['journal_failures']}")
    for dump in res.stalls:
        out.append(dump)
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of full size (default 1)")
    ap.add_argument("--interval-ms", type=float, default=50.0, help="good publisher's period")
    ap.add_argument("--tail-s", type=float, default=2.0, help="probing after each flood was sent")
    add_json_option(ap)
    ap.add_argument("--advisor-root", type=Path, default=ROOT, help="checkout whose advisor runs (to compare)")
    ap.add_argument("--hostile", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hostile is not None:
        hostile_main(args.hostile)
        return 0
    report = Report("flood", "a well-behaved publisher's index latency while one peer floods the advisor")
    res = run(args.scale, interval_s=args.interval_ms / 1000, tail_s=args.tail_s, advisor_root=args.advisor_root)
    print(table(res))
    goal_ms = LATENCY_GOAL_S * 1000
    worst = max((r.max_ms for r in res.rows), default=0.0)
    ok = res.unindexed == 0 and worst <= goal_ms and res.peak_rss_mib * (1 << 20) <= RSS_BOUND
    for r in res.rows:
        report.add(f"index latency p99 during the {r.flood} flood ({r.size:,})", r.p99_ms, r.base_p99_ms, unit="ms",
                   reference_name="p99 with no flood, same run", goal=f"max <= {goal_ms:.0f} ms",
                   met=r.max_ms <= goal_ms, better="lower")
    report.add("worst index latency over every flood", worst, goal_ms, unit="ms", reference_name="the promise",
               goal=f"<= {goal_ms:.0f} ms, every good batch indexed", met=worst <= goal_ms and res.unindexed == 0,
               better="lower", headline=True)
    report.add("peak advisor RSS", res.peak_rss_mib, RSS_BOUND / (1 << 20), unit="MiB",
               reference_name="documented bound", goal="under the bound",
               met=res.peak_rss_mib * (1 << 20) <= RSS_BOUND, better="lower")
    report.extra = asdict(res)
    report.write(args.json)
    print(f"goal (every good batch indexed within {LATENCY_GOAL_S:g} s, RSS under the bound): "
          f"{'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
