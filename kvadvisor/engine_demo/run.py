"""``kvadvisor demo --engine vllm``: the whole loop with real engines.

Topology (docs/design.md §1, embedded mode, with real engines in place of the simulated
workers of :mod:`kvadvisor.demo`)::

    replay client ──HTTP (stream)──▶ vllm serve engine-i  (kvbm connector: G2, volumes)
        │  POST /query                 │ vLLM KV events        │ connector events (G2, volumes)
        │                              │ (G1; G2 and volumes as CPU / DISK / EXTERNAL)
        ▼                              ▼                       ▼
    advisor (python -m advisor): journal → index → policies → mover; REST + indexer API
                          volumes: fast (POSIX) · archive (S3 on a local moto endpoint)
                          placement catalog: one SQLite file shared by everyone

The advisor, the local S3 endpoint, the advisor client and the consistency pieces are
:mod:`kvadvisor.demo`'s; this module adds the engines (:mod:`.engines`), the router
(:mod:`.router`) and the HTTP replay (:mod:`.replay`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field

from event_plane import PublisherConfig
from kvadvisor.demo import (
    AdvisorClient,
    DemoError,
    _descriptor_json,
    _env,
    advisor_moves,
    advisor_process,
    open_workdir,
    write_advisor_config,
)
from kvadvisor.trace import bundled_trace, read_mooncake
from kvbm_runtime.config import RuntimeConfig
from kvbm_runtime.testing.llama_model import LlamaGeometry, build_llama
from storage_backends import MediaClass, SqliteCatalog, VolumeDescriptor, VolumeKind, free_port, start_local_s3

from .engines import EngineProcess, EngineSpec, parse_prometheus, serve_engines
from .replay import RequestResult, percentile, replay, trace_prompt
from .router import KvRouter, RoundRobinRouter, Router

FAST, ARCHIVE = "fast", "archive"
PAGE = 32
Mode = Literal["vllm", "g2", "volumes"]


class EngineDemoSettings(BaseModel):
    """Parameters of one replay with real engines (sizes in blocks of ``PAGE`` tokens).

    ``mode``: ``vllm`` = no connector (vLLM's own prefix cache only); ``g2`` = the connector
    with a host pool only; ``volumes`` = G2 + the shared volumes.  ``moves``: the advisor
    runs policy rounds every ``policy_interval_s`` during the replay.
    """

    requests: int = Field(200, ge=1, description="replay the first N requests of the trace")
    warmup: int = Field(0, ge=0, description="of those, the first N warm the caches and are left out of the figures")
    engines: int = Field(2, ge=1, le=8)
    trace: Path | None = None
    block_tokens: int = Field(32, ge=1, description="tokens per trace block (the trace's are 512)")
    time_scale: float = Field(10.0, gt=0, description="trace time divided by this")
    warmup_time_scale: float | None = Field(None, gt=0, description="the warm-up's trace time divided by this "
                                            "(default: time_scale); the measured requests start once the warm-up is done")
    router: Literal["kv", "round-robin"] = "kv"
    overlap_weight: float = Field(1.0, ge=0)
    mode: Mode = "volumes"
    moves: bool = True
    sync_loads: bool = Field(True, description="load from the POSIX volume within the engine step (the connector's "
                                                "default); False: every volume load asynchronous")
    max_tokens: int = Field(8, ge=1)
    max_model_len: int = Field(2048, ge=PAGE)
    g1_blocks: int = Field(128, ge=2)
    g2_blocks: int = Field(256, ge=1)
    fast_capacity_blocks: int = Field(1024, ge=1)
    policy_interval_s: float = Field(2.0, gt=0)
    sample: int = Field(8, ge=0, description="requests checked token-identical against an engine without the connector")
    layers: int = Field(2, ge=1)
    hidden: int = Field(128, ge=32)
    head_dim: int = Field(32, ge=8, description="width of one attention head; hidden / head_dim heads")
    kv_heads: int = Field(0, ge=0, description="KV heads (grouped-query attention); 0: half the heads")
    intermediate: int = Field(0, ge=0, description="MLP width; 0: 2 x hidden")
    workdir: Path | None = None
    models_dir: Path | None = Field(None, description="build the model here and reuse it across runs (default: the workdir)")
    keep: bool = False
    start_timeout_s: float = Field(600.0, gt=0)
    engine_threads: int = Field(1, ge=1, description="CPU threads per engine (OMP_NUM_THREADS, not bound to cores)")

    def geometry(self) -> LlamaGeometry:
        """The random-weight Llama's shape: ``hidden / head_dim`` heads, ``kv_heads`` KV heads
        (default half the heads), an MLP of ``intermediate`` (default ``2 × hidden``).

        Raises:
            ValueError: ``hidden`` is not a multiple of ``head_dim``, or the heads are not a
                multiple of the KV heads.
        """
        if self.hidden % self.head_dim:
            raise ValueError(f"hidden {self.hidden} is not a multiple of head_dim {self.head_dim}")
        heads = max(2, self.hidden // self.head_dim)
        kv = self.kv_heads or heads // 2
        if heads % kv:
            raise ValueError(f"{heads} attention heads are not a multiple of {kv} KV heads")
        return LlamaGeometry(hidden=self.hidden, layers=self.layers, heads=heads, kv_heads=kv,
                             intermediate=self.intermediate or 2 * self.hidden, max_positions=self.max_model_len)


@dataclass
class EngineDemoReport:
    """Figures of one replay (tokens; seconds; counts).  ``ttft_s`` (mean, p50, p90, p99 of
    the measured requests) counts from each request's arrival, the router's decision
    included (:func:`.replay.replay`)."""

    requests: int = 0
    measured: int = 0
    engines: int = 0
    mode: str = ""
    router: str = ""
    block_tokens: int = 0
    time_scale: float = 0.0
    failed: int = 0
    ttft_s: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    prefill_computed: int = 0
    prefill_saved: int = 0
    vllm_cached_by_source: dict[str, float] = field(default_factory=dict)
    vllm_external_hits: float = 0.0
    kvbm: dict[str, float] = field(default_factory=dict)
    moves: dict[str, Any] = field(default_factory=dict)
    router_choices: dict[str, Any] = field(default_factory=dict)
    consistency: dict[str, Any] = field(default_factory=dict)
    outputs_checked: int = 0
    outputs_identical: int = 0
    namespace: str = ""
    api_url: str = ""
    workdir: str = ""
    wall_s: float = 0.0
    start_s: float = 0.0
    replay_s: float = 0.0
    settle_s: float = 0.0
    results: list[RequestResult] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serialisable; per-request results left out)."""
        d = asdict(self)
        d.pop("results")
        return d

    @property
    def consistent(self) -> bool:
        """Every volume's index equals its catalog (``mode="vllm"``: no volume, ``False``)."""
        locs = [v for v in self.consistency.values() if isinstance(v, dict) and "equal" in v]
        return bool(locs) and all(v["equal"] for v in locs)


def connector_namespace(model_dir: Path, g: LlamaGeometry, block_size: int = PAGE) -> str:
    """The storage namespace the connector of a vLLM engine on ``model_dir`` writes under
    (the fingerprint :func:`kvbm_runtime.vllm_adapter.runtime_config_from_vllm` builds)."""
    cfg = RuntimeConfig(model_name=str(model_dir), num_layers=g.layers, outer_dim=2, page_size=block_size,
                        inner_dim=g.kv_heads * g.head_size, kv_dtype="float32", g1_blocks=1)
    return cfg.fingerprint().namespace()


def _volumes(workdir: Path, s: EngineDemoSettings, block_bytes: int, endpoint: str, access: str, secret: str) -> list[VolumeDescriptor]:
    cat = SqliteCatalog(workdir / "catalog.sqlite")
    try:
        prefix = f"kv/{cat.catalog_id()}"
    finally:
        cat.close()
    seg = max(block_bytes * 32, 1 << 20)
    return [
        VolumeDescriptor(FAST, VolumeKind.POSIX, MediaClass.NVME, s.fast_capacity_blocks * block_bytes,
                         root=str(workdir / "volumes" / FAST), segment_bytes=seg),
        VolumeDescriptor(ARCHIVE, VolumeKind.S3, MediaClass.OBJECT, 1 << 40, endpoint=endpoint,
                         bucket="kvadvisor-engines", prefix=prefix, segment_bytes=seg,
                         access_key=access, secret_key=secret),
    ]


def _connector_supports(key: str) -> bool:
    from kvbm_runtime.vllm_adapter import ConnectorSettings

    return key in ConnectorSettings.model_fields


def connector_config(s: EngineDemoSettings, i: int, events_url: str, advisor_json: Path, fast: VolumeDescriptor,
                     catalog: Path) -> dict[str, Any] | None:
    """``kv_connector_extra_config`` of engine ``i`` (``None``: no connector)."""
    if s.mode == "vllm":
        return None
    extra: dict[str, Any] = {"events_url": events_url, "source": f"kvbm-{i}", "g2_blocks": s.g2_blocks}
    if s.mode == "volumes":
        if _connector_supports("storage_config"):  # one declaration, shared with the advisor
            extra["storage_config"] = str(advisor_json)
            if not s.sync_loads:
                extra["sync_load_volumes"] = []
        else:  # the connector registers one volume: the landing one
            d = _descriptor_json(fast)
            extra["volume"] = {k: v for k, v in d.items() if k in ("id", "kind", "media", "capacity_bytes", "root", "segment_bytes")}
            extra["storage_catalog"] = str(catalog)
    return extra


class _PolicyRounds:
    """Runs one advisor policy round every ``interval_s`` on a thread until stopped."""

    def __init__(self, client: AdvisorClient, interval_s: float) -> None:
        self.client, self.interval_s = client, interval_s
        self.rounds = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="policy-rounds", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.once()

    def once(self) -> None:
        try:
            self.client.run_policies()
            self.rounds += 1
        except httpx.HTTPError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> _PolicyRounds:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=120)


def _settle(client: AdvisorClient, quiet_s: float = 1.5, timeout_s: float = 30.0) -> dict[str, Any]:
    """Wait until the advisor's sources stop advancing for ``quiet_s``; return the last stats.

    Quiet sources do not mean that every event was folded: a connector's publisher may
    still hold its last batch (up to its flush time limit, :data:`DRAIN_TIMEOUT_S`); what
    the volumes hold is waited for by :func:`volume_agreement`."""
    last: Any = None
    since = time.monotonic()
    deadline = since + timeout_s
    while True:
        st = client.stats()
        seqs = {k: (v.get("epoch"), v.get("last_seq")) for k, v in st.get("sources", {}).items()}
        now = time.monotonic()
        if seqs != last:
            last, since = seqs, now
        elif now - since >= quiet_s or now > deadline:
            return st
        time.sleep(0.2)


def _metric_delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _kvbm_metrics(port: int) -> dict[str, float]:
    try:
        return parse_prometheus(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0).text)
    except httpx.HTTPError:
        return {}


DRAIN_TIMEOUT_S = 3 * PublisherConfig().max_delay_s
"""Seconds the volume check waits for the advisor's index to agree with the placement catalog.

The connector writes a block to a volume (the catalog has it at once) and publishes its
Store; its publisher sends the pending batch after the flush time limit, which grows to
``max_delay_s`` (10 s) when the event rate falls (docs/events.md §3.1), as it does at the
end of a replay.  So the engines' last Stores reach the advisor up to that long after the
last request; three times that leaves room for the last offloads and a loaded machine.  A
lost event is never folded: the check still fails, after this long."""

SHOWN_HASHES = 10
"""Sequence hashes a disagreeing volume lists (``missing``, ``extra``)."""


def volume_agreement(client: AdvisorClient, catalog_path: Path, volumes: tuple[str, ...] = (FAST, ARCHIVE),
                     timeout_s: float = DRAIN_TIMEOUT_S, poll_s: float = 0.25) -> dict[str, dict[str, Any]]:
    """Compare the advisor's index with the placement catalog on each volume, once the event
    pipeline has drained: read both (sets of sequence hashes) every ``poll_s`` seconds until
    they are equal on every volume or ``timeout_s`` seconds have passed.

    The catalog is written before the Store that announces a write is published, and the
    publisher may hold that Store for its flush time limit (:data:`DRAIN_TIMEOUT_S`): an
    index behind the catalog catches up, a lost or misordered event leaves it different.

    Returns:
        ``{volume: {"index": n, "held": n, "equal": bool, "waited_s": s}}``: blocks the index
        and the catalog place there, whether the sets are equal, and the seconds waited
        until they were (or until the timeout); a volume left unequal also has ``missing``
        (in the catalog, not in the index) and ``extra`` (in the index, not in the catalog):
        at most :data:`SHOWN_HASHES` ``0x`` hashes each, the smallest first.

    Raises:
        httpx.HTTPError: the advisor's API did not answer or refused a read.
        sqlite3.Error: the catalog cannot be read.
    """
    t0 = time.monotonic()
    cat = SqliteCatalog(catalog_path)
    try:
        while True:
            sets = {v: (client.blocks_at(v), {p.key.sequence_hash for p in cat.iter_volume(v)}) for v in volumes}
            waited = time.monotonic() - t0
            if all(idx == held for idx, held in sets.values()) or waited >= timeout_s:
                break
            time.sleep(poll_s)
    finally:
        cat.close()
    out: dict[str, dict[str, Any]] = {}
    for v, (idx, held) in sets.items():
        row: dict[str, Any] = {"index": len(idx), "held": len(held), "equal": idx == held, "waited_s": round(waited, 2)}
        if idx != held:
            row["missing"] = [f"{h:#018x}" for h in sorted(held - idx)[:SHOWN_HASHES]]
            row["extra"] = [f"{h:#018x}" for h in sorted(idx - held)[:SHOWN_HASHES]]
        out[v] = row
    return out


def check_consistency(client: AdvisorClient, catalog_path: Path, n_engines: int, model_name: str, mode: Mode,
                      timeout_s: float = DRAIN_TIMEOUT_S) -> dict[str, Any]:
    """Compare the advisor's index with what holds the blocks.

    * each volume: the index's blocks at ``fast`` / ``archive`` against the placement
      catalog's (sets of sequence hashes), once the engines' last events reached the
      advisor (:func:`volume_agreement`, which waits up to ``timeout_s`` seconds);
    * each engine's G1, for information: the advisor's index at ``vllm-<i>/g1`` (folded from
      vLLM's KV events) against the indexer's ``g1`` blocks of that engine (``GET /dump``,
      the same events folded by the router's index, which counts each physical copy of a
      block: vLLM may hold two copies of one hash and evict one).  vLLM does not say what
      its G1 holds, so this row compares two folds, not a fold with the truth, and does not
      decide the check.

    Returns ``{volume: {"index": n, "held": n, "equal": bool, "waited_s": s, ...},
    "vllm-<i>/g1": {"index": n, "indexer": n, "agree": bool}}`` (the volume rows as
    :func:`volume_agreement` gives them).
    """
    out: dict[str, Any] = {}
    if mode == "volumes":
        out.update(volume_agreement(client, catalog_path, timeout_s=timeout_s))
    held = indexer_blocks(client, model_name, "g1")
    for i in range(n_engines):
        idx = client.blocks_at(f"vllm-{i}/g1")
        n = len(held.get(i, ()))
        out[f"vllm-{i}/g1"] = {"index": len(idx), "indexer": n, "agree": len(idx) == n}
    return out


def indexer_blocks(client: AdvisorClient, model_name: str, tier: str) -> dict[int, set[int]]:
    """Per instance id, the block hashes the indexer API's index of ``model_name`` holds on
    ``tier`` (``g1`` ... ``g4``), walking ``GET /dump``'s pages."""
    out: dict[int, set[int]] = {}
    cursor: str | None = None
    while True:
        r = client.http.get("/dump", params={"limit": 1000, **({"cursor": cursor} if cursor else {})})
        r.raise_for_status()
        for ev in r.json().get(f"{model_name}:default", []):
            st = ev["event"]["stored"]
            if st["medium"] == tier:
                out.setdefault(int(ev["instance_id"]), set()).update(int(b["block_hash"]) for b in st["blocks"])
        cursor = r.headers.get("X-Next-Cursor")
        if not cursor:
            return out


def run_engine_demo(s: EngineDemoSettings, progress: Callable[[int, int], None] | None = None,
                    on_ready: Callable[[str], None] | None = None) -> EngineDemoReport:
    """Replay ``s.requests`` requests of the trace through ``s.engines`` real vLLM engines
    (module doc) and return the report.

    Raises:
        DemoError: a component did not start (an engine, the advisor).
        EngineError: an engine exited or did not serve in time.
        TraceFormatError: the trace is malformed.
    """
    t0 = time.monotonic()
    reqs = list(read_mooncake(s.trace or bundled_trace(), limit=s.requests))
    if not reqs:
        raise DemoError("the trace has no requests")
    env = _env()
    with ExitStack() as stack:
        workdir = open_workdir(stack, s.workdir, s.keep, "kvadvisor-engines-", "kvadvisor demo --engine vllm")
        g = s.geometry()
        model_dir = build_llama((s.models_dir or workdir) / f"model-{g.layers}x{g.hidden}-{g.kv_heads}kv{g.head_size}-{g.intermediate}", g)
        model = str(model_dir)
        block_bytes = g.kv_bytes_per_token() * PAGE
        namespace = connector_namespace(model_dir, g)

        s3 = start_local_s3()
        stack.callback(s3.stop)
        catalog = workdir / "catalog.sqlite"
        volumes = _volumes(workdir, s, block_bytes, s3.endpoint, s3.access_key, s3.secret_key)
        kv_ports = [(free_port(), free_port()) for _ in range(s.engines)]  # (events, replay)
        conn_urls = [f"zmq://127.0.0.1:{free_port()}?replay={free_port()}" for _ in range(s.engines)]
        # vLLM's stream also carries the connector's G2 / volume blocks (for the router's
        # index); the advisor takes those from the connector's own stream, under its volume ids
        subs = [f"vllm+zmq://127.0.0.1:{p}?replay={q}&source=vllm-{i}&topic=kv&model={model}&media=GPU"
                for i, (p, q) in enumerate(kv_ports)]
        if s.mode != "vllm":
            subs += conn_urls
        adv_pub = f"zmq://127.0.0.1:{free_port()}?replay={free_port()}"
        adv_cfg: dict[str, Any] = {
            "source": "advisor-0", "subscribe_urls": subs, "publish_url": adv_pub,
            "journal_path": str(workdir / "journal.sqlite"), "catalog_path": str(catalog),
            "namespace": namespace, "volumes": [_descriptor_json(v) for v in volumes],
            "fast_volume": FAST, "slow_volumes": [], "archive_volume": ARCHIVE,
            "policy": {"promotion": {"min_hits": 2}, "demotion": {"high_watermark": 0.8, "low_watermark": 0.6},
                       "compaction": {"live_fraction": 0.75}},
            "policy_interval_s": s.policy_interval_s, "api_host": "127.0.0.1", "api_port": free_port(),
        }
        advisor_json = write_advisor_config(adv_cfg, workdir)
        api_url = stack.enter_context(advisor_process(adv_cfg, workdir, env))
        client = AdvisorClient(api_url)
        stack.callback(client.close)
        for i, (p, q) in enumerate(kv_ports):
            r = client.http.post("/register", json={
                "instance_id": i, "endpoint": f"tcp://127.0.0.1:{p}", "replay_endpoint": f"tcp://127.0.0.1:{q}",
                "model_name": model, "block_size": PAGE})
            r.raise_for_status()
        if on_ready:
            on_ready(api_url)

        kvbm_ports = [free_port() for _ in range(s.engines)]
        specs: list[EngineSpec] = []
        for i in range(s.engines):
            extra = connector_config(s, i, conn_urls[i], advisor_json, volumes[0], catalog)
            eng_env = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
                       "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
                       "DYN_KVBM_METRICS": "true", "DYN_KVBM_METRICS_PORT": str(kvbm_ports[i])}
            specs.append(EngineSpec(f"engine-{i}", model_dir, free_port(), s.g1_blocks, workdir / f"engine-{i}.log",
                                    max_model_len=s.max_model_len, block_bytes=block_bytes, connector=extra,
                                    kv_events_port=kv_ports[i][0], kv_replay_port=kv_ports[i][1], env=eng_env))
        if s.sample:
            specs.append(EngineSpec("reference", model_dir, free_port(), s.g1_blocks, workdir / "reference.log",
                                    max_model_len=s.max_model_len, block_bytes=block_bytes))
        # engines share the machine's cores: no binding, a fixed thread count each
        threads = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(s.engine_threads)}
        specs = [dataclasses.replace(sp, env={**sp.env, **threads}) for sp in specs]
        t_start = time.monotonic()
        procs = stack.enter_context(serve_engines(specs, env, s.start_timeout_s))
        report_start_s = time.monotonic() - t_start
        engines, reference = procs[: s.engines], (procs[s.engines] if s.sample else None)

        max_prompt = s.max_model_len - s.max_tokens
        prompts = [trace_prompt(r, s.block_tokens, g.vocab, max_prompt) for r in reqs]
        base = reqs[0].timestamp_ms
        arrivals = [(r.timestamp_ms - base) / 1000.0 / s.time_scale for r in reqs]
        warm_scale = s.warmup_time_scale or s.time_scale
        warm_arrivals = [(r.timestamp_ms - base) / 1000.0 / warm_scale for r in reqs[: s.warmup]]

        report = EngineDemoReport(requests=len(reqs), engines=s.engines, mode=s.mode, router=s.router,
                                  block_tokens=s.block_tokens, time_scale=s.time_scale, namespace=namespace,
                                  api_url=api_url, workdir=str(workdir))

        async def run_replay() -> tuple[list[RequestResult], Router]:
            async with httpx.AsyncClient(base_url=api_url, headers=dict(client.http.headers), timeout=30.0) as http:
                router: Router = (KvRouter(http, model, list(range(s.engines)), PAGE, s.overlap_weight)
                                  if s.router == "kv" else RoundRobinRouter(s.engines))
                urls = [e.spec.url for e in engines]
                warm: list[RequestResult] = []
                if s.warmup:
                    warm = await replay(prompts[: s.warmup], warm_arrivals, urls, model, router, s.max_tokens)
                    before.update(_snapshot(engines, kvbm_ports))
                w0 = arrivals[s.warmup] if s.warmup < len(arrivals) else 0.0
                rest = await replay(prompts[s.warmup:], [a - w0 for a in arrivals[s.warmup:]], urls, model, router,
                                    s.max_tokens, progress)
                for r in rest:
                    r.index += s.warmup
                    r.burst += s.warmup
                return warm + rest, router

        before: dict[str, dict[str, float]] = _snapshot(engines, kvbm_ports)
        t_replay = time.monotonic()
        if s.moves and s.mode == "volumes":
            with _PolicyRounds(client, s.policy_interval_s) as rounds:
                results, router = asyncio.run(run_replay())
            _settle(client)
            volume_agreement(client, catalog)  # the connectors' last Stores are folded
            rounds.once()  # so this round sees the replay's last blocks too
        else:
            rounds = None
            results, router = asyncio.run(run_replay())
        report.replay_s = time.monotonic() - t_replay
        report.start_s = report_start_s
        after = _snapshot(engines, kvbm_ports)
        report.results = results
        measured = [r for r in results if r.index >= s.warmup]
        ok = [r for r in measured if r.error is None]
        report.measured = len(measured)
        report.failed = len(measured) - len(ok)
        ttfts = [r.ttft_s for r in ok]
        report.ttft_s = {"mean": sum(ttfts) / len(ttfts) if ttfts else 0.0,
                         "p50": percentile(ttfts, 50), "p90": percentile(ttfts, 90), "p99": percentile(ttfts, 99)}
        report.prompt_tokens = sum(r.prompt_tokens for r in ok)
        report.prefill_saved = sum(r.cached_tokens for r in ok)
        report.prefill_computed = report.prompt_tokens - report.prefill_saved
        for src in ("device", "host", "disk", "p2p", "external_unspecified"):
            report.vllm_cached_by_source[src] = sum(
                _metric_delta(after[e.spec.name], before[e.spec.name], f"vllm:prompt_tokens_cached_by_source{{{src}}}")
                for e in engines)
        report.vllm_external_hits = sum(_metric_delta(after[e.spec.name], before[e.spec.name], "vllm:external_prefix_cache_hits")
                                        for e in engines)
        names = ["kvbm_offload_blocks_d2h", "kvbm_offload_blocks_h2d", "kvbm_offload_blocks_d2d",
                 "kvbm_onboard_blocks_h2d", "kvbm_onboard_blocks_d2d", "kvbm_onboard_errors",
                 "kvbm_onboard_storage_seconds_sum", "kvbm_onboard_storage_seconds_count"]
        names += sorted({k for i in range(s.engines) for k in after[f"kvbm-{i}"] if k.startswith("kvbm_onboard_blocks_volume{")})
        for name in names:
            report.kvbm[name] = sum(_metric_delta(after[f"kvbm-{i}"], before[f"kvbm-{i}"], name) for i in range(s.engines))
        # a gauge: its value at the end, per engine
        for i in range(s.engines):
            report.kvbm[f"kvbm_g2_resident_blocks{{engine-{i}}}"] = after[f"kvbm-{i}"].get("kvbm_g2_resident_blocks", 0.0)

        t_settle = time.monotonic()
        st = _settle(client)
        report.settle_s = time.monotonic() - t_settle
        report.moves = advisor_moves(st)
        report.moves["policy_rounds"] = rounds.rounds if rounds else 0
        if rounds and rounds.errors:
            report.moves["round_errors"] = rounds.errors[:5]
        stats = getattr(router, "stats")
        report.router_choices = {"router": router.name, "per_engine": {f"engine-{k}": v for k, v in sorted(stats.per_engine.items())},
                                 "with_overlap": stats.with_overlap, "with_shared_overlap": stats.with_shared_overlap,
                                 "to_best_overlap": stats.to_best_overlap,
                                 "query_errors": stats.query_errors,
                                 # requests routed together (arrived at one moment; every
                                 # request), and the router's share of TTFT (route_s, window)
                                 "bursts": len({r.burst for r in results}),
                                 "largest_burst": max(Counter(r.burst for r in results).values(), default=0),
                                 "route_ms_mean": 1000 * sum(r.route_s for r in ok) / max(len(ok), 1),
                                 "route_ms_max": 1000 * max((r.route_s for r in ok), default=0.0)}
        report.consistency = check_consistency(client, catalog, s.engines, model, s.mode)

        if reference is not None:
            report.outputs_checked, report.outputs_identical = _check_outputs(reference, model, prompts, ok, s)
        report.wall_s = time.monotonic() - t0
        return report


def _snapshot(engines: list[EngineProcess], kvbm_ports: list[int]) -> dict[str, dict[str, float]]:
    out = {e.spec.name: e.metrics() for e in engines}
    out.update({f"kvbm-{i}": _kvbm_metrics(p) for i, p in enumerate(kvbm_ports)})
    return out


def _check_outputs(reference: EngineProcess, model: str, prompts: list[list[int]], ok: list[RequestResult],
                   s: EngineDemoSettings) -> tuple[int, int]:
    """Send ``s.sample`` of the served requests (evenly spaced, those that hit a cache first)
    to the engine without the connector, one at a time; count identical outputs."""
    from .replay import complete

    hits = [r for r in ok if r.cached_tokens > 0]
    rest = [r for r in ok if r.cached_tokens == 0]
    pool = hits + rest
    step = max(1, len(pool) // max(1, s.sample))
    chosen = pool[::step][: s.sample]

    async def go() -> int:
        same = 0
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
            for r in chosen:
                _, _, out, _ = await complete(http, reference.spec.url, model, prompts[r.index], s.max_tokens)
                same += int(tuple(out) == r.output)
        return same

    return len(chosen), asyncio.run(go())
