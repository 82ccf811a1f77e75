"""``kvadvisor demo``: replay a real trace through every part of kvadvisor.

Topology (docs/design.md §1, embedded mode)::

    this process                                   advisor process (python -m advisor)
    ┌───────────────────────────────┐  ZMQ / NATS  ┌──────────────────────────────────┐
    │ worker-0 BlockManager ── pub ─┼────────────▶ │ journal (SQLite) → PrefixIndex    │
    │ worker-1 BlockManager ── pub ─┼────────────▶ │ policies → mover (NIXL) → events  │
    │   G1/G2 torch pools           │              │ REST API (uvicorn)                │
    │   G3 via StorageAgent ────────┼─┐            └────────────┬─────────────────────┘
    └───────────────────────────────┘ │ NIXL put/get           │ NIXL get/put
                                      ▼                        ▼
                   volumes: fast/ (posix), slow/ (posix), s3 (NIXL OBJ on a local S3 endpoint)
                   placement catalog: one SQLite file shared by both processes

Each request's prompt tokens are synthesized from its block ids (``kvadvisor.trace``), the
workers hash them, look up the longest cached prefix across G1, G2 and the volumes, compute
(fill) the missing blocks, register and offload them; the advisor folds the events and
promotes, demotes and compacts.  The report gives the figures the issue asks for.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from event_plane import EventPublisher, make_publisher
from kvadvisor.settings import DemoSettings
from kvadvisor.trace import TraceRequest, bundled_trace, read_mooncake, request_tokens
from kvadvisor.workdir_lock import WorkdirLockedError, workdir_lock
from kvbm_runtime import BlockManager, RuntimeConfig, ServeResult, fill_synthetic_kv, synthetic_block_bytes
from storage_backends import (
    LocalS3,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    StorageError,
    VolumeDescriptor,
    VolumeKind,
    free_port,
    start_local_s3,
)

FAST, SLOW, S3 = "fast", "slow", "s3"


class DemoError(RuntimeError):
    """The replay could not run (advisor did not start, did not catch up, ...)."""


@dataclass
class DemoReport:
    """Figures of one replay (counts; bytes; seconds)."""

    requests: int = 0
    workers: int = 0
    blocks: int = 0
    computed_blocks: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {"g1": 0, "g2": 0, "g3": 0, "g4": 0})
    events: int = 0
    worker_events: int = 0
    advisor_events: int = 0
    batches: int = 0
    event_bytes_per_event: float = 0.0
    payload_bytes_per_event: float = 0.0
    promotions: int = 0
    demotions: int = 0
    compactions: int = 0
    bytes_moved: int = 0
    moves_by_route: dict[str, int] = field(default_factory=dict)
    tier_blocks: dict[str, int] = field(default_factory=dict)
    lookups: dict[str, Any] = field(default_factory=dict)
    """The API's lookup hit rates over the whole run (``/v1/stats`` ``hit_rates.lookup.total``:
    ``{"lookups": n, "tiers": {"G1": {"hits", "blocks", "tokens", "hit_rate"}, ...}}``)."""
    block_bytes: int = 0
    failed_moves: dict[str, int] = field(default_factory=lambda: {"promote": 0, "demote": 0, "compact": 0})
    deferred_volume_full: int = 0
    offload_failed: dict[str, int] = field(default_factory=dict)
    """Blocks the workers could not offload to their G3 volume, by error type (e.g.
    ``VolumeFullError`` while the advisor had not yet demoted enough to S3): the blocks stay
    on G1/G2 and are computed again if evicted there; nothing stored is lost."""
    advisor_events_per_s: float = 0.0
    ingest_basis: str = "journal + apply, busy time"
    """What ``advisor_events_per_s`` divides by (the embedded advisor's busy time; scaled mode:
    the time from the first request until every partition caught up)."""
    api_url: str = ""
    event_urls: list[str] = field(default_factory=list)
    transport: str = ""
    wall_s: float = 0.0
    volumes: list[dict[str, Any]] = field(default_factory=list)
    index_blocks: dict[str, int] = field(default_factory=dict)
    verified: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per event source of this run, ``{"batches", "events"}`` (scaled mode: each worker as its
    publishers counted, each cluster mover as the partitions applied it; ``GET /v1/stats``
    ``sources`` lists the same figures as the advisor side applied them)."""

    def add_served(self, res: ServeResult) -> None:
        """Count one served request: its blocks, the computed ones, hits per tier and the
        blocks whose offload failed (``res.errors`` of stage ``"offload"``)."""
        self.blocks += res.num_blocks
        self.computed_blocks += res.computed
        for tier in ("g1", "g2", "g3", "g4"):
            self.hits[tier] += getattr(res, f"hits_{tier}")
        for err in res.errors:
            if err.stage == "offload":
                self.offload_failed[err.error] = self.offload_failed.get(err.error, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serialisable)."""
        return asdict(self)


@dataclass
class Topology:
    """Where everything of one replay lives."""

    workdir: Path
    catalog_path: Path
    journal_path: Path
    volumes: list[VolumeDescriptor]
    worker_pub_urls: list[str]
    worker_sub_urls: list[str]
    advisor_pub_url: str
    api_host: str
    api_port: int
    s3: LocalS3 | None


def size_tiers(s: DemoSettings, reqs: list[TraceRequest]) -> DemoSettings:
    """``s`` with every tier size left unset (``None``) sized to the replayed slice.

    With ``U`` the slice's distinct full blocks (what write-through offload puts on ``slow``):
    G1 = ``max(U/80, longest request + 1)`` blocks per worker (a request must fit in G1),
    G2 = ``max(U/20, 4 × G1)`` per worker, ``fast`` = 3 % of ``U``, ``slow`` = ``U/2`` and
    ``s3`` = ``2 × U``.  So ``slow`` passes its demotion watermark (80 %) part-way through the
    replay and its cold blocks go down to S3, ``fast`` holds only the hottest prefixes, and
    later requests find blocks on every tier (for the bundled slice's first 1,000 requests:
    U = 20,527, G1 256, G2 1,026, fast 615, slow 10,263, s3 41,054 blocks).  A size set
    explicitly is kept as it is.

    Args:
        s: the settings; sizes in blocks.
        reqs: the requests that will be replayed.
    """
    seen: set[int] = set()
    longest = 0
    for r in reqs:
        full = min(r.input_length // s.page_size, len(r.hash_ids))
        seen.update(r.hash_ids[:full])
        longest = max(longest, full)
    u = len(seen)
    g1 = s.g1_blocks or max(u // 80, longest + 1, 16)
    sizes = {
        "g1_blocks": g1,
        "g2_blocks": s.g2_blocks or max(u // 20, 4 * g1),
        "fast_capacity_blocks": s.fast_capacity_blocks or max(u * 3 // 100, 32),
        "slow_capacity_blocks": s.slow_capacity_blocks or max(u // 2, 256),
        "s3_capacity_blocks": s.s3_capacity_blocks or max(2 * u, 1024),
    }
    return s.model_copy(update=sizes)


def tier_blocks(s: DemoSettings) -> dict[str, int]:
    """Size of each tier in blocks: ``g1`` and ``g2`` per worker, then the volumes."""
    return {"g1": s.g1_blocks or 0, "g2": s.g2_blocks or 0, FAST: s.fast_capacity_blocks or 0,
            SLOW: s.slow_capacity_blocks or 0, S3: s.s3_capacity_blocks or 0}


def block_bytes(s: DemoSettings) -> int:
    """Bytes of one KV block of the demo's geometry (float16)."""
    return s.num_layers * s.outer_dim * s.page_size * s.inner_dim * 2


def _volumes(s: DemoSettings, workdir: Path, s3_endpoint: str, access: str | None, secret: str | None) -> list[VolumeDescriptor]:
    """The three volumes: ``fast`` and ``slow`` directories, and the ``s3`` bucket under the
    prefix ``kv/<catalog id>`` of this working directory's catalog, so two demos against one
    S3 endpoint never share a prefix (a prefix owned by another catalog is refused)."""
    cat = SqliteCatalog(workdir / "catalog.sqlite")
    try:
        prefix = f"kv/{cat.catalog_id()}"
    finally:
        cat.close()
    bb = block_bytes(s)
    seg = max(bb * 32, 1 << 20)
    return [
        VolumeDescriptor(FAST, VolumeKind.POSIX, MediaClass.NVME, s.fast_capacity_blocks * bb,
                         root=str(workdir / "volumes" / FAST), segment_bytes=seg),
        VolumeDescriptor(SLOW, VolumeKind.POSIX, MediaClass.HDD, s.slow_capacity_blocks * bb,
                         root=str(workdir / "volumes" / SLOW), segment_bytes=seg),
        VolumeDescriptor(S3, VolumeKind.S3, MediaClass.OBJECT, s.s3_capacity_blocks * bb,
                         endpoint=s3_endpoint, bucket=s.s3_bucket, prefix=prefix, segment_bytes=seg,
                         access_key=access, secret_key=secret),
    ]


def _worker_urls(s: DemoSettings, i: int) -> tuple[str, str]:
    """(publisher URL, subscriber URL) of worker ``i``."""
    use_nats = s.transport == "nats" or (s.transport == "mixed" and i % 2 == 1)
    if use_nats:
        url = f"{s.nats_url}?namespace={s.nats_namespace}"
        return url, url
    pub, rep = free_port(), free_port()
    return f"zmq://127.0.0.1:{pub}?replay={rep}", f"zmq://127.0.0.1:{pub}?replay={rep}"


def runtime_config(s: DemoSettings) -> RuntimeConfig:
    """The workers' runtime configuration (same model fingerprint for every worker)."""
    return RuntimeConfig(
        model_name="demo/mooncake-conversation",
        num_layers=s.num_layers,
        outer_dim=s.outer_dim,
        page_size=s.page_size,
        inner_dim=s.inner_dim,
        kv_dtype="float16",
        g1_blocks=s.g1_blocks,
        g2_blocks=s.g2_blocks,
        disk_offload_filter=s.disk_offload_filter,
    )


def advisor_config(s: DemoSettings, topo: Topology, namespace: str) -> dict[str, Any]:
    """JSON settings for ``python -m advisor --config`` (see ``advisor.settings.AdvisorSettings``)."""
    vols = []
    for v in topo.volumes:
        d = _descriptor_json(v)
        vols.append(d)
    return {
        "source": "advisor-0",
        "subscribe_urls": sorted(set(topo.worker_sub_urls)),
        "publish_url": topo.advisor_pub_url,
        "journal_path": str(topo.journal_path),
        "catalog_path": str(topo.catalog_path),
        "namespace": namespace,
        "volumes": vols,
        "fast_volume": FAST,
        "slow_volumes": [SLOW],
        "archive_volume": S3,
        "policy": {
            "promotion": {"min_hits": 2},
            "demotion": {"high_watermark": 0.8, "low_watermark": 0.6},
            "compaction": {"live_fraction": s.compaction_live_fraction},
            "planner": {"max_moves_per_round": s.max_moves_per_round,
                        "max_compactions_per_round": s.max_compactions_per_round},
        },
        # `advisor run` on the work directory runs its rounds on a timer (the demo's own
        # advisor process runs with the timer off: the replay drives its rounds, see
        # DEMO_RUN_OVERRIDES)
        "policy_interval_s": 30,
        "api_host": topo.api_host,
        "api_port": topo.api_port,
    }


DEMO_RUN_OVERRIDES: dict[str, Any] = {"policy_interval_s": 0}
"""What the demo's own advisor process runs with instead of ``advisor.json``: the replay
runs a policy round every ``policy_every`` requests itself, and its verification compares
the index with the catalog, which a timer round could change between the two reads."""


def _descriptor_json(v: VolumeDescriptor) -> dict[str, Any]:
    d = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
    d["kind"] = v.kind.value
    d["media"] = v.media.value
    return {k: val for k, val in d.items() if val is not None}


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable and writable by the owner only (mode 0600, also
    when the file existed with a wider mode), so no other user ever sees its content."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return path


def write_advisor_config(config: dict[str, Any], workdir: Path, name: str = "advisor.json") -> Path:
    """Write the advisor's JSON settings to ``workdir/<name>`` (mode 0600).

    A volume's ``secret_key`` is never written into it: it goes to its own file
    ``workdir/<volume id>.secret`` (mode 0600), named by the volume's ``secret_key_file``.

    Returns:
        The path of the file written.
    """
    cfg = json.loads(json.dumps(config))
    for v in cfg.get("volumes", []):
        secret = v.pop("secret_key", None)
        if secret:
            v["secret_key_file"] = str(write_private(workdir / f"{v['id']}.secret", str(secret) + "\n"))
    return write_private(workdir / name, json.dumps(cfg, indent=2))


@contextmanager
def advisor_process(config: dict[str, Any], workdir: Path, env: dict[str, str], timeout_s: float = 60.0) -> Iterator[str]:
    """Start the advisor service as its own process; yield its API URL; stop it on exit.

    Raises:
        DemoError: if the process exits or does not print ``ADVISOR READY <url>`` in time.
    """
    cfg_path = write_advisor_config(config, workdir)
    # what this process runs: advisor.json + the demo's overrides (timer off: the replay drives rounds)
    run_path = write_advisor_config({**config, **DEMO_RUN_OVERRIDES}, workdir, "advisor.demo-run.json")
    log_path = workdir / "advisor.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "advisor", "--config", str(run_path)],
        stdout=subprocess.PIPE,
        stderr=log,
        env=env,
    )
    assert proc.stdout is not None
    url: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            log.write(raw)
            log.flush()
            if line.startswith("ADVISOR READY"):
                url.append(line.split()[-1])
                ready.set()
        ready.set()

    t = threading.Thread(target=pump, name="advisor-stdout", daemon=True)
    t.start()
    try:
        if not ready.wait(timeout_s) or not url:
            log.flush()
            raise DemoError(advisor_start_failure(log_path.read_text(errors="replace"), proc.poll(), log_path))
        yield url[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        t.join(timeout=5)
        log.close()


def advisor_start_failure(log_text: str, exit_code: int | None, log_path: Path) -> str:
    """One line for an advisor that did not start: its own ``advisor: start failed: ...`` line
    (the cause) when the log has one, else the log's last line; then where the log is."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    cause = next((ln.split("start failed:", 1)[1].strip() for ln in reversed(lines) if "start failed:" in ln), None)
    if cause is None:
        cause = (lines[-1] if lines else "no output") + (f" (exit code {exit_code})" if exit_code is not None else "")
    return f"the advisor did not start: {cause} (its log: {log_path})"


class AdvisorClient:
    """Thin REST client of the advisor's API (used by the demo and the e2e test).

    Args:
        base_url: ``http://HOST:PORT`` of the API.
        token: bearer token (default: the first admin token of ``KVADVISOR_API_ADMIN_TOKENS``,
            the API's own settings, when any is set; none otherwise).
    """

    def __init__(self, base_url: str, token: str | None = None) -> None:
        self.base_url = base_url
        if token is None:
            from api.auth import ApiSecuritySettings

            admins = ApiSecuritySettings().admin_tokens
            token = admins[0].get_secret_value() if admins else None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url, timeout=120.0, headers=headers)

    def stats(self) -> dict[str, Any]:
        r = self.http.get("/v1/stats")
        r.raise_for_status()
        return r.json()

    def volumes(self) -> Any:
        r = self.http.get("/v1/volumes")
        r.raise_for_status()
        return r.json()

    def run_policies(self) -> Any:
        r = self.http.post("/v1/plans/run")
        r.raise_for_status()
        return r.json()

    def blocks_at(self, location: str) -> set[int]:
        """Every sequence hash at ``location``, walking the route's pages."""
        out: set[int] = set()
        cursor: str | None = None
        while True:
            params = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
            r = self.http.get(f"/v1/locations/{location}/blocks", params=params)
            r.raise_for_status()
            body = r.json()
            out.update(int(h) for h in body["sequence_hashes"])
            cursor = body.get("next_cursor")
            if not cursor:
                return out

    def wait_caught_up(self, publishers: list[EventPublisher], timeout_s: float = 120.0) -> dict[str, Any]:
        """Block until the advisor has applied every batch the publishers sent and carried
        out every prefetch its router lookups asked for (``/v1/stats`` ``prefetch.pending``
        is 0), so the index, the catalog and the volumes hold still for a comparison.

        Raises:
            DemoError: on timeout, naming the sources still behind (or the prefetches left).
        """
        want = {p.source: (p.epoch, p.stats().batches - 1) for p in publishers}
        deadline = time.monotonic() + timeout_s
        behind: dict[str, Any] = {}
        while True:
            st = self.stats()
            sources = st.get("sources", {})
            behind = {
                src: (sources.get(src), want_seq)
                for src, (epoch, want_seq) in want.items()
                if want_seq >= 0
                and not (
                    src in sources
                    and int(sources[src]["epoch"]) == epoch
                    and int(sources[src]["last_seq"]) >= want_seq
                )
            }
            pending = int(st.get("prefetch", {}).get("pending", 0))
            if not behind and not pending:
                return st
            if time.monotonic() > deadline:
                raise DemoError(f"advisor did not catch up within {timeout_s} s: sources behind {behind}, "
                                f"prefetches pending {pending}")
            time.sleep(0.05)

    def lookup_tokens(self, tokens: Any, fingerprint: Any) -> dict[str, Any]:
        """Ask ``POST /v1/lookup`` what a router asks before it routes a request: the longest
        cached prefix of these prompt tokens per location, tier and worker (the API hashes the
        tokens as the runtime does, salted with the model ``fingerprint``,
        ``kvbm_runtime.ModelFingerprint``).  The API counts it in its hit rates per tier."""
        fp = fingerprint
        body = {"token_ids": [int(t) for t in tokens],
                "model": {"name": fp.name, "dtype": fp.dtype, "layout": fp.layout, "block_size": fp.block_size,
                          "revision": fp.revision}}
        r = self.http.post("/v1/lookup", json=body)
        r.raise_for_status()
        return r.json()

    def close(self) -> None:
        self.http.close()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def open_workdir(stack: ExitStack, workdir: Path | None, keep: bool, prefix: str, holder: str) -> Path:
    """The demo's working directory, locked for ``stack``'s life: ``workdir`` (made
    absolute: advisor.json names its paths from here, and ``advisor run`` may start
    anywhere), or a new temporary one removed on exit unless ``keep`` or the run fails (its
    logs say why; the path is printed on stderr).

    Raises:
        DemoError: another process holds the directory's lock, or ``workdir`` is a file or
            cannot be created.
    """
    path = prepare_workdir(workdir) if workdir else Path(tempfile.mkdtemp(prefix=prefix))
    try:
        stack.enter_context(workdir_lock(path, holder))
    except WorkdirLockedError as exc:
        raise DemoError(str(exc)) from None
    if not keep and not workdir:
        def remove_unless_failed(exc_type: type[BaseException] | None, *_: object) -> None:
            if exc_type is None or exc_type is KeyboardInterrupt:
                shutil.rmtree(path, ignore_errors=True)
            else:  # the logs say why
                print(f"kept the work directory of the failed run: {path}", file=sys.stderr)

        stack.push(remove_unless_failed)
    return path


def run_demo(
    s: DemoSettings,
    progress: Callable[[int, int], None] | None = None,
    inspect: Callable[[DemoReport, AdvisorClient, list[BlockManager], StorageAgent], None] | None = None,
    on_ready: Callable[[str, list[str]], None] | None = None,
) -> DemoReport:
    """Replay ``s.requests`` requests of the trace and return the report.

    ``progress(done, total)`` is called after every request.  ``inspect`` (used by the
    end-to-end test) is called while every component is still up.  ``on_ready(api_url,
    event_urls)`` is called once the advisor serves, before the replay starts.

    Raises:
        DemoError: if a component fails to start or the advisor falls behind.
        TraceFormatError: if the trace is malformed.
    """
    t0 = time.monotonic()
    trace_path = s.trace or bundled_trace()
    reqs = list(read_mooncake(trace_path, limit=s.requests))
    if not reqs:
        raise DemoError(f"the trace {trace_path} has no requests")
    s = size_tiers(s, reqs)
    env = _env()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with ExitStack() as stack:
        workdir = open_workdir(stack, s.workdir, s.keep, "kvadvisor-demo-", "kvadvisor demo")
        s3: LocalS3 | None = None
        endpoint = s.s3_endpoint
        access, secret = s.s3_access_key, s.s3_secret_key
        if endpoint is None:
            _refuse_stale_s3_workdir(workdir)
            s3 = start_local_s3()
            stack.callback(s3.stop)
            endpoint, access, secret = s3.endpoint, s3.access_key, s3.secret_key
        else:
            check_s3_endpoint(endpoint, access, secret)
        urls = [_worker_urls(s, i) for i in range(s.workers)]
        adv_pub, adv_rep = free_port(), free_port()
        topo = Topology(
            workdir=workdir,
            catalog_path=workdir / "catalog.sqlite",
            journal_path=workdir / "journal.sqlite",
            volumes=_volumes(s, workdir, endpoint, access, secret),
            worker_pub_urls=[u[0] for u in urls],
            worker_sub_urls=[u[1] for u in urls],
            advisor_pub_url=f"zmq://127.0.0.1:{adv_pub}?replay={adv_rep}",
            api_host="127.0.0.1",
            api_port=s.api_port or free_port(),
            s3=s3,
        )
        rcfg = runtime_config(s)
        namespace = rcfg.fingerprint().namespace()
        # Workers bind their publishers before the advisor subscribes, so it catches up on
        # anything sent early through their replay sockets (docs/design.md §3, docs/events.md §5.2).
        publishers: list[EventPublisher] = []
        for i in range(s.workers):
            pub = make_publisher(topo.worker_pub_urls[i], source=f"worker-{i}")
            publishers.append(pub)
            stack.callback(pub.close)
        api_url = stack.enter_context(advisor_process(advisor_config(s, topo, namespace), workdir, env))
        client = AdvisorClient(api_url)
        stack.callback(client.close)

        agent = StorageAgent(SqliteCatalog(topo.catalog_path), name="demo-workers")
        stack.callback(agent.close)
        for v in topo.volumes:
            agent.register_volume(v)
        managers: list[BlockManager] = []
        for pub in publishers:
            mgr = BlockManager(rcfg, pub, store=agent, g3_volume=SLOW)
            managers.append(mgr)
            stack.callback(mgr.close)

        report = DemoReport(
            requests=len(reqs),
            workers=s.workers,
            api_url=api_url,
            event_urls=list(dict.fromkeys(topo.worker_sub_urls)) + [topo.advisor_pub_url],  # worker order
            transport=s.transport,
            tier_blocks=tier_blocks(s),
            block_bytes=block_bytes(s),
        )
        if on_ready:
            on_ready(api_url, report.event_urls)
        fingerprint = rcfg.fingerprint()
        for n, req in enumerate(reqs, 1):
            mgr = managers[(n - 1) % s.workers]
            tokens = request_tokens(req, s.page_size)
            if s.router_lookups:
                # what a KV-aware router asks before it routes: counted in the API's hit rates
                client.lookup_tokens(tokens, fingerprint)
            report.add_served(mgr.serve(tokens, fill_synthetic_kv))
            if n % s.policy_every == 0 or n == len(reqs):
                for p in publishers:
                    p.flush()
                client.wait_caught_up(publishers)
                client.run_policies()
            if progress:
                progress(n, len(reqs))

        for p in publishers:
            p.flush()
        st = client.wait_caught_up(publishers)
        _fill_report(report, st, publishers, client)
        if s.verify or inspect:
            report.verified = verify_consistency(client, managers, agent, s)
        if inspect:
            inspect(report, client, managers, agent)
        report.wall_s = time.monotonic() - t0
        return report


def _fill_report(report: DemoReport, st: dict[str, Any], publishers: list[EventPublisher], client: AdvisorClient) -> None:
    ev = sum(p.stats().events for p in publishers)
    pb = sum(p.stats().payload_bytes for p in publishers)
    eb = sum(p.stats().event_bytes for p in publishers)
    report.worker_events = ev
    report.batches = sum(p.stats().batches for p in publishers)
    report.event_bytes_per_event = eb / ev if ev else 0.0
    report.payload_bytes_per_event = pb / ev if ev else 0.0
    mv = advisor_moves(st)
    report.promotions = mv["promotions"]
    report.demotions = mv["demotions"]
    report.compactions = mv["compactions"]
    report.bytes_moved = mv["bytes_moved"]
    report.failed_moves = mv["failed"]
    report.moves_by_route = mv["routes"]
    report.deferred_volume_full = int(st.get("ingest", {}).get("deferred_volume_full", 0))
    report.advisor_events = int(st.get("advisor_events", 0))
    report.events = report.worker_events + report.advisor_events
    report.advisor_events_per_s = float(st.get("ingest_events_per_busy_s", 0.0))
    report.index_blocks = {k: int(v) for k, v in st.get("blocks_per_location", {}).items()}
    report.lookups = st.get("hit_rates", {}).get("lookup", {}).get("total", {})
    report.volumes = client.volumes()


def advisor_moves(st: dict[str, Any]) -> dict[str, Any]:
    """The advisor's moves from its ``GET /v1/stats`` body: ``promotions``, ``demotions``,
    ``compactions``, ``bytes_moved`` (counts, bytes), ``failed`` (per kind) and ``routes`` (moves per
    ``src->dst`` route)."""
    mv = st.get("moves", {})
    return {
        "promotions": int(mv.get("promotions", 0)),
        "demotions": int(mv.get("demotions", 0)),
        "compactions": int(mv.get("compactions", 0)),
        "bytes_moved": int(mv.get("bytes_moved", 0)),
        "failed": {k: int(v) for k, v in mv.get("failed", {}).items()},
        "routes": {k: int(v) for k, v in mv.get("routes", {}).items()},
    }


def prepare_workdir(path: Path) -> Path:
    """Create ``path`` (and its parents) when missing; return it absolute.

    Raises:
        DemoError: ``path`` is a file, or cannot be created (the reason, then what to do).
    """
    workdir = Path(path).expanduser().resolve()
    if workdir.exists() and not workdir.is_dir():
        raise DemoError(f"--workdir {path} is a file, not a directory; pass a directory (created when missing)")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoError(f"--workdir {path} cannot be created ({exc.strerror or exc}); pass a directory you can "
                        "write (created when missing)") from None
    return workdir


S3_HINT = ("start one that outlives the demo, e.g. `.venv/bin/moto_server -p 9000` with "
           "AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test (moto accepts any), or leave out --s3-endpoint "
           "(the demo then starts its own)")


def check_s3_endpoint(endpoint: str, access: str | None, secret: str | None, timeout_s: float = 3.0) -> None:
    """Fail fast, before anything starts, when the S3 endpoint does not answer or no
    credentials are set (the advisor would fail the same way, with the cause at the end of a
    long log line).

    Raises:
        DemoError: the cause first, then :data:`S3_HINT`.
    """
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(endpoint)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise DemoError(f"--s3-endpoint {endpoint!r} is not an http(s)://HOST:PORT address; {S3_HINT}")
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        raise DemoError(f"the S3 endpoint {endpoint} does not answer ({exc.strerror or exc}); {S3_HINT}") from None
    if not (access and secret):
        import boto3

        if boto3.Session().get_credentials() is None:
            raise DemoError(f"no S3 credentials for {endpoint}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                            "(or an AWS profile); moto_server accepts any")


def _refuse_stale_s3_workdir(workdir: Path) -> None:
    """Refuse a reused work directory whose blocks on ``s3`` lived in an earlier demo's own S3.

    The local S3 endpoint the demo starts (moto) keeps objects in memory and stops with the
    demo, so the catalog and journal of a kept work directory would point at objects that no
    longer exist.  Nothing is changed: the caller picks a new directory or a persistent S3.

    Raises:
        DemoError: the catalog in ``workdir`` places blocks on the ``s3`` volume.
    """
    path = workdir / "catalog.sqlite"
    if not path.exists():
        return
    cat = SqliteCatalog(path)
    try:
        n = sum(1 for _ in cat.iter_volume(S3))
    finally:
        cat.close()
    if n:
        raise DemoError(
            f"--workdir {workdir} holds {n:,} block(s) on the 's3' volume of an earlier demo, whose "
            "local S3 endpoint kept its objects in memory and is gone; use a new --workdir, or pass "
            "--s3-endpoint (with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) of an S3 that outlives the demo"
        )


def verify_consistency(client: AdvisorClient, managers: list[BlockManager], agent: StorageAgent, s: DemoSettings) -> dict[str, Any]:
    """Compare the advisor's index with what the runtimes and the storage agent hold.

    Returns a dict per location: ``{"index": n, "held": n, "equal": bool}`` plus
    ``"bytes_ok"``/``"bytes_checked"`` for blocks read back from their final volume
    (through NIXL) against the bytes the runtime wrote (recomputed from the hash).
    """
    out: dict[str, Any] = {}
    for mgr in managers:
        src = mgr.publisher.source
        for tier in ("g1", "g2"):
            held = mgr.resident(tier)
            idx = client.blocks_at(f"{src}/{tier}")
            out[f"{src}/{tier}"] = {"index": len(idx), "held": len(held), "equal": idx == held}
    for v in (FAST, SLOW, S3):
        held = {p.key.sequence_hash for p in agent.catalog.iter_volume(v)}
        idx = client.blocks_at(v)
        out[v] = {"index": len(idx), "held": len(held), "equal": idx == held}
    checked, ok, failures = read_back(agent, s)
    out["bytes_checked"] = checked
    out["bytes_ok"] = ok
    if failures:
        out["unreadable"] = failures[:10]
    return out


def read_back(agent: StorageAgent, s: DemoSettings) -> tuple[int, int, list[str]]:
    """Read every block the catalog places on the demo's volumes and compare it with the bytes
    the runtime wrote (recomputed from its sequence hash, :func:`synthetic_block_bytes`).

    Returns:
        ``(checked, byte_exact, unreadable)``: blocks read, blocks equal to what was written, and
        the failures: for a batched read that raised, one line with its error, then one line
        per block that could not be read alone (``"<volume>: <hash>: <error>"``); an
        unreadable copy (segment gone, truncated, corrupt) counts as checked and not exact
        instead of stopping the check.
    """
    shape = (s.num_layers, s.outer_dim, s.page_size, s.inner_dim)
    checked = ok = 0
    failures: list[str] = []
    for v in (FAST, SLOW, S3):
        placements = list(agent.catalog.iter_volume(v))
        for i in range(0, len(placements), 256):
            chunk = placements[i : i + 256]
            try:
                datas: list[torch.Tensor | None] = list(agent.get([p.key for p in chunk]))
            except StorageError as chunk_exc:
                # Some copy in the chunk is unreadable (gone, truncated, corrupt; the agent
                # quarantines it): read the blocks one by one so each unreadable one counts
                # as failed, after a line with the reason the batched read gave.
                failures.append(f"{v}: a read of {len(chunk)} blocks failed: {type(chunk_exc).__name__}: {chunk_exc}")
                datas = []
                for p in chunk:
                    try:
                        datas.append(agent.get([p.key])[0])
                    except StorageError as exc:
                        datas.append(None)
                        failures.append(f"{v}: {p.key.sequence_hash:#x}: {type(exc).__name__}: {exc}")
            for p, data in zip(chunk, datas):
                want = synthetic_block_bytes(p.key.sequence_hash, shape, torch.float16)
                checked += 1
                ok += int(data is not None and torch.equal(data.reshape(-1), want))
    return checked, ok, failures
