"""The ``kvadvisor`` command line (typer + rich)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Annotated, Optional, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from event_plane.cli import events_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="KV-cache block tiering: runtime, event plane, advisor, API.")
advisor_app = typer.Typer(no_args_is_help=True, help="Run the advisor service.")
app.add_typer(advisor_app, name="advisor")
app.add_typer(events_app, name="events")
nats_app = typer.Typer(no_args_is_help=True, help="NATS worker users of the topology `kvadvisor up` started.")
app.add_typer(nats_app, name="nats")
console = Console(stderr=False)
T = TypeVar("T")


@app.callback()
def _each_invocation() -> None:
    """Build the output console for this invocation, so the terminal width it uses is the
    environment's now (``COLUMNS``), not the one at import (rich fixes the width when a
    ``Console`` is made with ``COLUMNS`` set)."""
    global console  # noqa: PLW0603 - one console per invocation, read by every command
    console = Console(stderr=False)


def _fail(msg: str) -> None:
    """Print ``error: msg`` on one line of stderr and exit with status 2."""
    typer.echo(f"error: {' '.join(str(msg).split())}", err=True)
    raise typer.Exit(2)


def _check_output(path: Path | None, what: str) -> None:
    """Fail before any work when an output file cannot be written."""
    if path is None:
        return
    parent = path.expanduser().resolve().parent
    if not parent.is_dir():
        _fail(f"{what}: directory {parent} does not exist")
    if path.exists() and path.is_dir():
        _fail(f"{what}: {path} is a directory")


_CLUSTER_DIR_HELP = "the directory given to `kvadvisor up`"


def _up_call(call: Callable[[], T]) -> T:
    """``call()`` (a function of :mod:`kvadvisor.up`); its ``UpError`` ends the command with
    ``error: …`` and status 2 (:func:`_fail`)."""
    from kvadvisor.up import UpError

    try:
        return call()
    except UpError as exc:
        _fail(str(exc))
        raise  # unreachable: _fail exits


def _load_cluster(cluster_dir: Path):  # noqa: ANN202 - kvadvisor.up.ClusterUp, imported lazily
    from kvadvisor.up import load

    return _up_call(lambda: load(cluster_dir))


@app.command()
def demo(
    trace: Annotated[Optional[Path], typer.Option(help="Mooncake jsonl trace (default: bundled 2,000-request slice)")] = None,
    requests: Annotated[Optional[int], typer.Option(help="replay only the first N requests (default 1000; 0 = all)")] = None,
    workers: Annotated[int, typer.Option(help="simulated inference workers")] = 2,
    transport: Annotated[str, typer.Option(help="zmq | nats | mixed")] = "zmq",
    nats_url: Annotated[str, typer.Option(help="NATS server for --transport nats/mixed")] = "nats://127.0.0.1:4222",
    s3_endpoint: Annotated[Optional[str], typer.Option(help="S3 endpoint (default: start a local one)")] = None,
    workdir: Annotated[Optional[Path], typer.Option(help="keep volumes, journal and catalog here")] = None,
    verify: Annotated[bool, typer.Option(help="check index == held blocks and read every block back")] = True,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the report as JSON")] = None,
    g1_blocks: Annotated[Optional[int], typer.Option(help="G1 blocks per worker (default: sized to the slice)", min=1)] = None,
    g2_blocks: Annotated[Optional[int], typer.Option(help="G2 blocks per worker (default: sized to the slice)", min=1)] = None,
    fast_blocks: Annotated[Optional[int], typer.Option(help="fast volume (G3) capacity in blocks (default: 3 % of the slice's blocks)", min=1)] = None,
    slow_blocks: Annotated[Optional[int], typer.Option(help="slow volume (G3) capacity in blocks (default: half the slice's blocks)", min=1)] = None,
    s3_blocks: Annotated[Optional[int], typer.Option(help="s3 volume (G4) capacity in blocks (default: twice the slice's blocks)", min=1)] = None,
    scaled: Annotated[bool, typer.Option("--scaled", help="replay through the topology `kvadvisor up` started")] = False,
    cluster_dir: Annotated[Path, typer.Option("--dir", help="--scaled: the directory given to `kvadvisor up`")] = Path("runs/cluster"),
    engine: Annotated[str, typer.Option(help="sim: simulated workers; vllm: real vLLM engines (`vllm serve`) with the connector")] = "sim",
    engines: Annotated[int, typer.Option(help="--engine vllm: engines to start")] = 2,
    block_tokens: Annotated[int, typer.Option(help="--engine vllm: tokens per trace block (the trace's are 512)")] = 32,
    time_scale: Annotated[float, typer.Option(help="--engine vllm: the trace's time is divided by this")] = 10.0,
    router: Annotated[str, typer.Option(help="--engine vllm: kv (overlap from POST /query weighed against load) | round-robin")] = "kv",
    sample: Annotated[int, typer.Option(help="--engine vllm: requests checked against an engine without the connector")] = 8,
) -> None:
    """Replay a real trace through workers, event plane, advisor, volumes and the REST API
    (``--scaled``: through the NATS cluster, Redis, S3 and cluster advisors of ``kvadvisor up``;
    ``--engine vllm``: through real vLLM engines, default the first 100 requests)."""
    import signal

    if engine == "vllm":
        from kvadvisor.engine_demo.cli import engine_demo

        engine_demo(requests=requests, engines=engines, trace=trace, block_tokens=block_tokens, time_scale=time_scale,
                    router=router, sample=sample, workdir=workdir, json_out=json_out, fail=_fail)
        return
    if engine != "sim":
        _fail(f"--engine must be sim or vllm, got {engine!r}")

    from kvadvisor.demo import DemoError, run_demo
    from kvadvisor.settings import DemoSettings
    from event_plane.errors import EventPlaneError
    from kvadvisor.trace import TraceFormatError
    from storage_backends import StorageError

    if requests is not None and requests < 0:
        _fail(f"--requests must be >= 0 (0 = all requests of the trace), got {requests}")
        return
    if trace is not None and not trace.exists():
        _fail(f"--trace {trace} does not exist; give a Mooncake jsonl file (or leave it out: the bundled slice)")
        return
    try:
        s = DemoSettings(
            trace=trace,
            requests=None if requests == 0 else (requests or 1000),
            workers=workers,
            transport=transport,  # type: ignore[arg-type]
            nats_url=nats_url,
            s3_endpoint=s3_endpoint,
            workdir=workdir,
            verify=verify,
            g1_blocks=g1_blocks,
            g2_blocks=g2_blocks,
            fast_capacity_blocks=fast_blocks,
            slow_capacity_blocks=slow_blocks,
            s3_capacity_blocks=s3_blocks,
        )
    except ValidationError as exc:
        from advisor.settings import format_validation_error

        _fail(f"invalid demo settings: {format_validation_error(exc)}")
        return
    _check_output(json_out, "--json")
    # SIGTERM unwinds like Ctrl-C, so the advisor process, the local S3 endpoint and the
    # work directory are cleaned up either way.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    bar = Progress(TextColumn("[bold]replaying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                   transient=False)
    task = bar.add_task("replay", total=s.requests or 0)

    def progress(done: int, total: int) -> None:
        if not bar.live.is_started:  # from the first request on: nothing of it before an early error
            bar.start()
        bar.update(task, completed=done, total=total)

    def stop_bar(erase: bool) -> None:
        if bar.live.is_started:  # (Progress.stop prints a newline even when it never started)
            bar.live.transient = erase
            bar.stop()

    def fail(msg: str) -> None:
        stop_bar(erase=True)  # an error erases the bar: the error line is the last thing printed
        _fail(msg)

    def ready(api_url: str, event_urls: list[str]) -> None:
        console.print(f"advisor API {api_url} (dashboard: {api_url}/dashboard)", soft_wrap=True, highlight=False)
        console.print("event streams (worker order, a shared NATS URL once; last: the advisor's): "
                      + "  ".join(f"'{u}'" for u in event_urls), soft_wrap=True, highlight=False, markup=False)

    try:
        if scaled:
            from kvadvisor.scaled_demo import run_scaled_demo
            from kvadvisor.up import UpError

            try:
                report = run_scaled_demo(s, cluster_dir, progress=progress)
            except UpError as exc:
                fail(str(exc))
                return
        else:
            report = run_demo(s, progress=progress, on_ready=ready)
        stop_bar(erase=False)
    except (DemoError, TraceFormatError, FileNotFoundError) as exc:
        fail(str(exc))
        return
    except (EventPlaneError, StorageError) as exc:  # e.g. NATS unreachable, S3 refused
        fail(f"{type(exc).__name__}: {exc}")
        return
    except KeyboardInterrupt:
        stop_bar(erase=True)
        typer.echo("error: interrupted; advisor, local S3 endpoint and work directory stopped", err=True)
        raise typer.Exit(130) from None
    _print_report(report)
    failed = sum(report.failed_moves.values())
    if failed:
        typer.echo(f"warning: {failed:,} advisor moves failed ({', '.join(f'{k}={v:,}' for k, v in report.failed_moves.items() if v)}"
                   f"{f'; {report.deferred_volume_full:,} held back by a full volume' if report.deferred_volume_full else ''}); "
                   "see GET /v1/plans and the advisor log", err=True)
    if s.requests is not None and report.requests < s.requests:
        console.print(f"note: the trace holds {report.requests:,} requests; all of them were replayed "
                      f"(--requests asked for {s.requests:,})")
    if json_out:
        json_out.write_text(json.dumps(report.as_dict(), indent=2, default=str))
    if verify and not _verified(report.verified):
        _fail("verification failed: the advisor's index or the stored bytes disagree with what is held")


def _verified(v: dict) -> bool:
    if not v:
        return False
    locs = [x for k, x in v.items() if isinstance(x, dict)]
    return all(x["equal"] for x in locs) and v.get("bytes_ok") == v.get("bytes_checked")


def _tier_sizes(r) -> str:  # noqa: ANN001 - DemoReport
    """``G1 256 + G2 1,026 per worker · fast 615 · slow 10,263 · s3 41,054 (16 KiB each)``."""
    t = r.tier_blocks
    if not t:
        return "-"
    per = f"G1 {t.get('g1', 0):,} + G2 {t.get('g2', 0):,} per worker"
    vols = " · ".join(f"{k} {t[k]:,}" for k in ("fast", "slow", "s3") if t.get(k))
    return f"{per} · {vols} ({r.block_bytes / 1024:,.0f} KiB each)"


def _lookup_rates(lk: dict) -> str:
    """``1,000 lookups: G1 12.0 % · G2 3.0 % · G3 80.0 % · G4 20.0 %`` (share of lookups whose
    first block that tier held; the figures ``kvadvisor status`` shows under "total")."""
    n = int(lk.get("lookups", 0)) if lk else 0
    if not n:
        return "none"
    tiers = lk.get("tiers", {})
    return f"{n:,} lookups: " + " · ".join(f"{t} {100 * tiers.get(t, {}).get('hit_rate', 0.0):.1f} %"
                                          for t in ("G1", "G2", "G3", "G4"))


def _print_report(r) -> None:  # noqa: ANN001 - DemoReport, imported lazily
    t = Table(title="kvadvisor demo report", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    blocks = max(r.blocks, 1)
    rows = [
        ("requests replayed", f"{r.requests:,} across {r.workers} workers"),
        ("full blocks requested", f"{r.blocks:,} ({r.computed_blocks:,} computed)"),
        ("events (workers + advisor)", f"{r.events:,} ({r.worker_events:,} + {r.advisor_events:,}) in {r.batches:,} worker batches"),
        *([("sources: batches / events", " · ".join(f"{k} {v['batches']:,} / {v['events']:,}"
                                                    for k, v in sorted(r.sources.items())))] if r.sources else []),
        ("bytes per event on the wire", f"{r.event_bytes_per_event:.1f} (event) / {r.payload_bytes_per_event:.1f} (with batch envelope)"),
        (f"advisor ingest ({r.ingest_basis})", f"{r.advisor_events_per_s:,.0f} events/s"),
        ("tier sizes (blocks)", _tier_sizes(r)),
        ("hits G1 / G2 / G3 / G4 (blocks)", " / ".join(f"{r.hits[k]:,}" for k in ("g1", "g2", "g3", "g4"))),
        ("hit rate (any tier)", f"{sum(r.hits.values()) / blocks:.3f}"),
        ("router lookups (POST /v1/lookup), hit rate per tier", _lookup_rates(r.lookups)),
        ("promotions / demotions / compactions", f"{r.promotions:,} / {r.demotions:,} / {r.compactions:,}"),
        ("moves per route", ", ".join(f"{k}={v:,}" for k, v in sorted(r.moves_by_route.items())) or "-"),
        ("bytes moved by the advisor", f"{r.bytes_moved:,}"),
        ("FAILED promotions / demotions / compactions",
         " / ".join(f"{r.failed_moves.get(k, 0):,}" for k in ("promote", "demote", "compact"))
         + (f" ({r.deferred_volume_full:,} held back: volume full)" if r.deferred_volume_full else "")),
        ("blocks the workers could not offload (kept on G1/G2)",
         ", ".join(f"{k}={v:,}" for k, v in sorted(r.offload_failed.items())) or "0"),
        ("index blocks per location", ", ".join(f"{k}={v:,}" for k, v in sorted(r.index_blocks.items()))),
        ("wall time", f"{r.wall_s:.1f} s"),
    ]
    if r.verified:
        locs = {k: x for k, x in r.verified.items() if isinstance(x, dict)}
        same = sum(1 for x in locs.values() if x["equal"])
        rows.append(("index == held blocks", f"{same}/{len(locs)} locations"))
        rows.append(("blocks read back byte-exact", f"{r.verified.get('bytes_ok', 0):,}/{r.verified.get('bytes_checked', 0):,}"))
        for line in r.verified.get("unreadable", []):
            rows.append(("unreadable block", line))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    # addresses outside the table, on lines of their own: a table cell would cut or fold them
    for line in (f"API (while it was up): {r.api_url}",
                 f"event streams ({r.transport}; worker order, last: the advisor's): " + " ".join(r.event_urls)):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


@app.command()
def up(
    cluster_dir: Annotated[Path, typer.Option("--dir", help="state, stores and logs of the topology")] = Path("runs/cluster"),
    nodes: Annotated[int, typer.Option(help="NATS servers (1: a single JetStream server; 3 or more: a cluster with 3 replicas)", min=1)] = 3,
    advisors: Annotated[int, typer.Option(help="cluster advisors")] = 3,
    partitions: Annotated[int, typer.Option(help="partitions of the prefix index")] = 8,
    policy_interval: Annotated[float, typer.Option(
        help="seconds between the advisors' policy rounds (a scaled demo waits for their rounds)", min=0.1)] = 5.0,
) -> None:
    """Start the scaled topology on loopback without Docker: a NATS JetStream cluster,
    redis-server, an S3 endpoint and cluster advisors (they keep running; `kvadvisor down`)."""
    from kvadvisor.up import up as start

    st = _up_call(lambda: start(cluster_dir, nodes=nodes, advisors=advisors, partitions=partitions,
                                policy_interval_s=policy_interval))
    console.print(f"NATS cluster {st.nats_url} · Redis 127.0.0.1 · S3 {st.s3_endpoint} · "
                  f"{len(st.advisors)} advisors own {st.partitions} partitions")
    console.print(f"API {st.api_url} (dashboard: {st.api_url}/dashboard)")
    console.print(f"state: {Path(st.root) / 'cluster.json'} (mode 0600) · logs: {Path(st.root) / 'logs'}")
    console.print(f"next: kvadvisor demo --scaled --dir {cluster_dir}    figures: kvadvisor status --dir {cluster_dir}    "
                  f"stop: kvadvisor down --dir {cluster_dir}", soft_wrap=True)
    console.print(f"a NATS user for a worker of your own (vLLM connector, events relay): "
                  f"kvadvisor nats add-worker SOURCE --dir {cluster_dir}", soft_wrap=True)


@app.command()
def down(
    cluster_dir: Annotated[Path, typer.Option("--dir", help=_CLUSTER_DIR_HELP)] = Path("runs/cluster"),
) -> None:
    """Stop the topology `kvadvisor up` started (advisors first, then the servers)."""
    from kvadvisor.up import down as stop

    names = _up_call(lambda: stop(cluster_dir))
    console.print(f"stopped: {', '.join(names)}")


@nats_app.command("add-worker")
def nats_add_worker(
    source: Annotated[str, typer.Argument(help="the worker's source name (its events' `source`), which is its NATS user")],
    cluster_dir: Annotated[Path, typer.Option("--dir", help=_CLUSTER_DIR_HELP)] = Path("runs/cluster"),
) -> None:
    """Make a NATS user for a worker of your own (a vLLM engine with the connector, `kvadvisor
    events relay`, `kvadvisor worker-sim`): it may publish only its own source's subject
    (`kvadvisor.events.*.SOURCE`). The running servers reload; its password file (mode 0600)
    is written and its path printed, never the password. An existing worker keeps its password."""
    from kvadvisor.up import add_worker

    state = _load_cluster(cluster_dir)
    user = _up_call(lambda: add_worker(state, source))
    typer.echo(f"password file: {user.password_file} (mode 0600, user {user.source})")
    typer.echo(f"publisher URL: {user.publisher_url}")
    typer.echo(f"or: export KVADVISOR_NATS_PASSWORD_FILE={user.password_file} (for a URL without credentials)")


@nats_app.command("remove-worker")
def nats_remove_worker(
    source: Annotated[str, typer.Argument(help="the worker's source name")],
    cluster_dir: Annotated[Path, typer.Option("--dir", help=_CLUSTER_DIR_HELP)] = Path("runs/cluster"),
) -> None:
    """Remove a worker's NATS user: the running servers reload and refuse it from then on
    (its connections are closed); its password file is deleted. Exit status 1 when there
    was no such worker."""
    from kvadvisor.up import remove_worker

    state = _load_cluster(cluster_dir)
    removed = _up_call(lambda: remove_worker(state, source))
    if not removed:
        typer.echo(f"no NATS worker user {source!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"removed NATS worker user {source}")


@nats_app.command("list-workers")
def nats_list_workers(
    cluster_dir: Annotated[Path, typer.Option("--dir", help=_CLUSTER_DIR_HELP)] = Path("runs/cluster"),
) -> None:
    """List the worker users (one name a line, with its password file when
    `add-worker` wrote one); never a password."""
    from kvadvisor.up import list_workers, password_file_path

    state = _load_cluster(cluster_dir)
    for source in list_workers(state):
        path = password_file_path(state, source)
        typer.echo(f"{source}\t{path if path.exists() else '-'}")


@app.command()
def evaluate(
    trace: Annotated[Optional[Path], typer.Option(help="Mooncake jsonl, or a WEKA trace_NNNN.json[.gz] file / directory")] = None,
    capacity: Annotated[Optional[str], typer.Option(help="fast-tier capacities in blocks, comma-separated")] = None,
    synthetic: Annotated[bool, typer.Option("--synthetic", help="evaluate the seeded synthetic robustness suite "
                                            "(docs/traces.md) at its own capacities, instead of --trace")] = False,
    seed: Annotated[int, typer.Option(help="--synthetic: seed of the generated traces")] = 0,
    variants: Annotated[bool, typer.Option("--variants", help="--synthetic: the same generators with other "
                                           "parameters (docs/traces.md), instead of the suite")] = False,
    format: Annotated[Optional[str], typer.Option("--format", help="mooncake | weka (default: from the name)")] = None,
    policies: Annotated[str, typer.Option(help="our policies to compare, comma-separated (adaptive = the default policy)")] = "adaptive",
    baselines: Annotated[str, typer.Option(help="online baselines, comma-separated (LRU always runs)")] = ",".join(
        ("lru", "arc", "lfu_da", "s3fifo", "sieve", "prefix_lru")),
    lookahead: Annotated[str, typer.Option(help="upcoming requests our policies see, comma-separated (e.g. 0,1,4,16)")] = "0",
    promote: Annotated[bool, typer.Option("--promote/--no-promote",
                                          help="with --lookahead: promote a visible request's known blocks (else only protect)")] = True,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="write a PNG plot of hit rate vs capacity")] = None,
    limit: Annotated[Optional[int], typer.Option(help="replay only the first N requests")] = None,
    stagger_s: Annotated[float, typer.Option(help="WEKA: seconds between conversation starts")] = 60.0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the results as JSON")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="also print the table as markdown")] = False,
    tiers: Annotated[Optional[str], typer.Option(
        help="time model: 'default' (NVMe 7 GB/s 0.1 ms 100,000 blocks, then S3 1.25 GB/s 30 ms) or "
             "name=GB/s:latency_ms:capacity_blocks,... below the fast tier; prints blocks ready in time "
             "and TTFT-proxy p50/p90 per capacity, with and without --lookahead")] = None,
) -> None:
    """Replay a trace (or the synthetic suite): fast-tier hit rate of the baselines, Belady and our policies per capacity."""
    from kvadvisor import evaluate as ev_mod
    from kvadvisor.trace import TraceFormatError

    _check_output(plot, "--plot")
    _check_output(json_out, "--json")
    if limit is not None and limit < 1:
        _fail("--limit must be at least 1")
    if synthetic:
        if trace is not None or capacity is not None:
            _fail("--synthetic replays generated traces at their own capacities: drop --trace and --capacity")
        try:
            evs = ev_mod.evaluate_synthetic(seed, [p.strip() for p in policies.split(",") if p.strip()],
                                            [p.strip() for p in baselines.split(",") if p.strip()],
                                            variants=variants)
        except ev_mod.EvaluateError as exc:
            _fail(str(exc))
            return
        for ev in evs:
            console.print(ev_mod.render_table(ev))
        console.print(ev_mod.summary_markdown(evs), markup=False, highlight=False, soft_wrap=True)
        console.print(f"replayed in {sum(ev.seconds for ev in evs):.1f} s")
        if json_out:
            json_out.write_text(json.dumps([ev.as_dict() for ev in evs], indent=2))
        return
    if variants:
        _fail("--variants goes with --synthetic")
        return
    if trace is None or capacity is None:
        _fail("pass --trace and --capacity (or --synthetic)")
        return
    try:
        caps = ev_mod.parse_capacities(capacity)
        ks = ev_mod.parse_lookaheads(lookahead)
        ct = ev_mod.load_compact(trace, format, limit, stagger_s)  # type: ignore[arg-type]
        result = ev_mod.evaluate(ct, caps,
                                 [p.strip() for p in policies.split(",") if p.strip()], ks,
                                 [p.strip() for p in baselines.split(",") if p.strip()], trace=trace.name,
                                 promote=promote)
    except (ev_mod.EvaluateError, TraceFormatError, FileNotFoundError) as exc:
        _fail(str(exc))
        return
    console.print(ev_mod.render_table(result))
    if markdown:
        console.print(ev_mod.markdown_table(result), markup=False, highlight=False, soft_wrap=True)
    console.print(f"replayed in {result.seconds:.1f} s")
    if any(k > 0 for k in ks):
        console.print("Lookahead columns: the policy promotes the next K requests' blocks from lower tiers, "
                      "which Belady cannot, so their gap closed is measured up to the infinite tier (every "
                      "block seen before is a hit); without --tiers those promotions are instant and free.")
    if tiers is not None:
        import time as _time

        import numpy as np

        from kvadvisor import timemodel

        try:
            model = timemodel.TimeModel(tiers=timemodel.parse_tiers(tiers))
            times = np.array(ev_mod.load_trace_times(trace, format, limit, stagger_s))  # type: ignore[arg-type]
        except (ValueError, TraceFormatError) as exc:
            _fail(str(exc))
            return
        t0 = _time.perf_counter()
        console.print(f"time model: {timemodel.describe(model)}")
        for cap in caps:
            rows = timemodel.evaluate_timed(ct, times, cap, ks, model)
            console.print(timemodel.timed_markdown(cap, rows), markup=False, highlight=False, soft_wrap=True)
        console.print("Ready in time can pass Belady's hit rate: with hints, blocks are promoted from the "
                      "lower tiers within their links' bandwidth before the prefill starts, while Belady (no "
                      "hints) only keeps blocks on the fast tier.")
        console.print(f"time model in {_time.perf_counter() - t0:.1f} s")
    if plot:
        console.print(f"plot: {ev_mod.plot(result, plot)}")
    if json_out:
        json_out.write_text(json.dumps(result.as_dict(), indent=2))


@app.command()
def status(
    url: Annotated[str, typer.Option(envvar="KVADVISOR_URL", help="the advisor API")] = "http://127.0.0.1:8080",
    token: Annotated[Optional[str], typer.Option(envvar="KVADVISOR_API_TOKEN", show_default=False,
                                                 help="read token (env KVADVISOR_API_TOKEN), when the API has tokens")] = None,
    cluster_dir: Annotated[Optional[Path], typer.Option("--dir", show_default=False,
                                                        help="the directory given to `kvadvisor up`: its cluster API (instead of --url)")] = None,
) -> None:
    """Print the figures an operator checks first (health, ingest, sources, namespaces, volumes,
    moves, hit rates)."""
    from kvadvisor.status import StatusError, fetch_status, print_status

    if cluster_dir is not None:
        url = _load_cluster(cluster_dir).api_url

    try:
        st = fetch_status(url, token)
    except StatusError as exc:
        _fail(str(exc))
    print_status(st, console)
    if st.health.get("status") != "ok":
        raise typer.Exit(1)


@app.command("worker-sim")
def worker_sim(
    nats: Annotated[Optional[str], typer.Option(help="NATS server(s), comma-separated")] = None,
    password_file: Annotated[Optional[Path], typer.Option(
        "--password-file", show_default=False,
        help="NATS password file of this worker's user (mode 0600; `kvadvisor nats add-worker` writes one; "
             "default $KVADVISOR_NATS_PASSWORD_FILE)")] = None,
    namespace: Annotated[Optional[str], typer.Option(help="event namespace of the cluster")] = None,
    source: Annotated[Optional[str], typer.Option(help="this worker's source name")] = None,
    partitions: Annotated[Optional[int], typer.Option(help="the cluster advisors' --partitions")] = None,
    replicas: Annotated[Optional[int], typer.Option(help="JetStream replicas of the events stream")] = None,
    manage_stream: Annotated[Optional[bool], typer.Option(
        "--manage-stream/--no-manage-stream",
        help="create the events stream if missing (a worker alone on a fresh NATS; default: the advisors do)")] = None,
    requests: Annotated[Optional[int], typer.Option(help="requests to replay (default: the whole trace)")] = None,
    loop: Annotated[Optional[bool], typer.Option("--loop/--once", help="start the trace again at its end")] = None,
    workdir: Annotated[Optional[Path], typer.Option(help="G3 volume and its catalog")] = None,
    storage: Annotated[Optional[Path], typer.Option(
        help="the cluster advisors' --storage file: G3 = its first slow volume in the shared Redis catalog "
             "(Redis URL from $KVADVISOR_CLUSTER_REDIS_URL)")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(help="kvbm_* /metrics port (default 6880)")] = None,
    metrics_host: Annotated[Optional[str], typer.Option(help="address of /metrics (default 127.0.0.1)")] = None,
) -> None:
    """Run one KVBM worker replaying the bundled trace into a scaled cluster (partitioned
    JetStream events, kvbm_* metrics); settings also from ``KVADVISOR_WORKER_SIM_*``."""
    import signal
    import threading

    from kvadvisor.worker_sim import WorkerSimSettings, run_worker_sim

    given = {"nats_url": nats, "password_file": password_file, "namespace": namespace, "source": source, "partitions": partitions,
             "replicas": replicas, "manage_stream": manage_stream, "requests": requests, "loop": loop,
             "workdir": workdir, "storage": storage,
             "metrics_port": metrics_port, "metrics_host": metrics_host}
    try:
        settings = WorkerSimSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        _fail(f"configuration error: {exc}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        n = run_worker_sim(settings, stop,
                           on_ready=lambda url: typer.echo(f"worker {settings.source} ready, metrics: {url}"))
    except (OSError, ValueError, RuntimeError) as exc:
        _fail(f"worker-sim: {exc}")
    typer.echo(f"worker {settings.source}: {n} requests served")


@app.command("check")
def check_cmd(
    workdir: Annotated[Optional[Path], typer.Option(help="a demo working directory (reads its advisor.json, locks it)")] = None,
    config: Annotated[Optional[Path], typer.Option(help="an advisor config file (instead of --workdir)")] = None,
    repair: Annotated[bool, typer.Option(help="make index, catalog and volumes agree (advisor must be stopped)")] = False,
    deep: Annotated[bool, typer.Option(help="also read every block and compare its checksum")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the report as JSON")] = None,
) -> None:
    """Compare the index (a fresh fold of the journal), the catalog and the volumes.

    Exit status: 0 when they agree (after --repair: when the repair left no difference),
    1 when differences remain, 2 on an error (bad config, directory in use).
    """
    from contextlib import nullcontext

    from advisor.settings import SettingsError
    from kvadvisor.check import check, load_settings
    from kvadvisor.workdir_lock import WorkdirLockedError, workdir_lock
    from storage_backends import StorageError

    _check_output(json_out, "--json")
    if workdir is not None and not workdir.is_dir():
        _fail(f"--workdir {workdir} is not a directory")
    try:
        settings = load_settings(workdir, config)
    except (SettingsError, ValueError) as exc:
        _fail(str(exc))
        return
    try:
        with workdir_lock(workdir, "kvadvisor check") if workdir is not None else nullcontext():
            report = check(settings, repair=repair, deep=deep)
            after = check(settings, deep=deep) if repair and report.differences else report
    except WorkdirLockedError as exc:
        _fail(str(exc))
        return
    except (StorageError, ValueError, RuntimeError) as exc:
        from advisor.embedded.service import start_failure_line

        _fail(start_failure_line(exc))
        return
    console.print(f"checked {report.blocks_checked:,} catalog placements against a fold of "
                  f"{report.journal_position:,} journal batches and the segments on each volume: "
                  f"{len(report.differences):,} differences", soft_wrap=True)
    if deep:
        console.print(f"deep: read back {report.blocks_read:,} blocks ({report.bytes_read:,} bytes) and compared each "
                      "with its catalog checksum", soft_wrap=True)
    if report.other_namespaces:
        console.print(f"note: the catalog also places {sum(report.other_namespaces.values()):,} blocks of namespaces "
                      f"{', '.join(sorted(report.other_namespaces))} on these volumes, not checked: list them in the "
                      f"advisor's \"extra_namespaces\" (or raise \"max_namespaces\") to manage them "
                      f"(now {', '.join(settings.namespaces)})",
                      soft_wrap=True, markup=False, highlight=False)
    for d in report.differences[:50]:
        console.print(f"  {d.line()}", markup=False, highlight=False)
    if len(report.differences) > 50:
        console.print(f"  ... and {len(report.differences) - 50:,} more (see --json)")
    lost = report.lost_blocks()
    if lost:
        console.print(f"lost blocks ({len(lost):,}): " + " ".join(f"{h:#x}" for h in lost[:100]), markup=False)
    if repair and report.differences:
        console.print("repaired: " + ", ".join(f"{k}={v:,}" for k, v in report.repaired.items())
                      + f"; {len(after.differences):,} differences left")
    if json_out:
        out = report.as_dict()
        out["differences_after_repair"] = len(after.differences)
        json_out.write_text(json.dumps(out, indent=2))
    if after.differences:
        raise typer.Exit(1)


@advisor_app.command("run")
def advisor_run(config: Annotated[Path, typer.Option(help="JSON settings file")]) -> None:
    """Run the advisor service in the foreground (same as ``python -m advisor --config``)."""
    from advisor.embedded.service import main

    sys.exit(main(["--config", str(config)]))


@advisor_app.command("origins")
def advisor_origins(
    config: Annotated[Path, typer.Option(help="JSON settings file of the advisor")],
    release: Annotated[Optional[list[str]], typer.Option("--release", help="release this source's binding (repeatable)")] = None,
) -> None:
    """List the advisor's source → origin bindings (JSON), or release some (``--release``).

    Works on the bindings file (``origins_path``) of a stopped advisor: a running one keeps
    its bindings in memory until it stops (in code: ``AdvisorService.release_origin``).
    """
    from advisor.ingest.origin_store import SqliteOriginStore
    from advisor.settings import AdvisorSettings, SettingsError

    try:
        settings = AdvisorSettings.from_json_file(config)
    except (SettingsError, ValueError) as exc:
        _fail(f"configuration error: {exc}")
    path = settings.origins_file
    if not Path(path).exists():
        _fail(f"no origin bindings file at {path}")
    store = SqliteOriginStore(path)
    try:
        missing = [src for src in release or [] if not store.release(src)]
        released = sorted(set(release or []) - set(missing))
        typer.echo(json.dumps({"origins_file": path, "bindings": store.load(), "released": released,
                               "not_bound": missing}))
    finally:
        store.close()
    if missing:
        raise typer.Exit(1)


if __name__ == "__main__":  # pragma: no cover
    app()
