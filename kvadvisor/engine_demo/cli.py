"""The ``kvadvisor demo --engine vllm`` command: settings from the flags, a progress bar,
the report as a table, and the exit status (2 when the consistency check or the output
check fails)."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .run import EngineDemoReport, EngineDemoSettings, run_engine_demo

DEFAULT_REQUESTS = 100
"""Requests replayed by default (about 3 minutes here, engine starts included)."""


def engine_demo(*, requests: int | None, engines: int, trace: Path | None, block_tokens: int, time_scale: float,
                router: str, sample: int, workdir: Path | None, json_out: Path | None,
                fail: Callable[[str], None], console: Console | None = None) -> None:
    """Run the replay with real engines and print its report; ``fail(msg)`` exits."""
    from kvadvisor.demo import DemoError
    from kvadvisor.trace import TraceFormatError

    from .engines import EngineError

    console = console or Console(width=max(Console().width, 140))
    try:
        s = EngineDemoSettings(requests=requests or DEFAULT_REQUESTS, engines=engines, trace=trace,
                               block_tokens=block_tokens, time_scale=time_scale, router=router,  # type: ignore[arg-type]
                               sample=sample, workdir=workdir, keep=workdir is not None)
    except ValidationError as exc:
        fail(f"invalid settings: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}")
        return
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with Progress(TextColumn("[bold]replaying on vLLM"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        task = bar.add_task("replay", total=s.requests)
        try:
            report = run_engine_demo(
                s, progress=lambda d, t: bar.update(task, completed=d, total=t),
                on_ready=lambda url: bar.console.print(f"advisor API {url}; starting {s.engines} engines"
                                                       f"{' and a reference engine' if s.sample else ''}"))
        except (DemoError, EngineError, TraceFormatError, FileNotFoundError) as exc:
            fail(str(exc))
            return
        except KeyboardInterrupt:
            fail("interrupted; engines, advisor and local S3 endpoint stopped")
            return
    console.print(report_table(report))
    if json_out:
        json_out.write_text(json.dumps(report.as_dict(), indent=2, default=str))
    if report.failed:
        fail(f"{report.failed} request(s) failed; see the engine logs")
    if not report.consistent:
        fail(f"consistency check failed: {report.consistency}")
    if report.outputs_identical != report.outputs_checked:
        fail(f"outputs differ from the engine without the connector: {report.outputs_identical}/{report.outputs_checked} identical")


def onboard_row(kvbm: dict[str, float]) -> str:
    """Blocks onboarded from each volume (read where the block was at read time) and the
    mean time of a storage read job, from the connector's counters; ``-`` when none."""
    vols = {k.split("{", 1)[1].rstrip("}"): v for k, v in kvbm.items() if k.startswith("kvbm_onboard_blocks_volume{")}
    if not vols:
        return "-"
    jobs = kvbm.get("kvbm_onboard_storage_seconds_count", 0)
    mean = kvbm.get("kvbm_onboard_storage_seconds_sum", 0) / jobs * 1000 if jobs else 0.0
    return " · ".join(f"{v} {n:,.0f}" for v, n in sorted(vols.items())) + f"; {jobs:,.0f} reads, {mean:,.1f} ms each on average"


def report_table(r: EngineDemoReport) -> Table:
    """The report as a two-column table."""
    t = Table(title="kvadvisor demo --engine vllm", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    tt = r.ttft_s
    mv = r.moves
    cached = r.vllm_cached_by_source
    rows = [
        ("requests", f"{r.measured:,} measured of {r.requests:,} ({r.failed} failed); {r.engines} engines, "
                     f"{r.block_tokens} tokens per trace block, trace time / {r.time_scale:g}"),
        ("TTFT mean / p50 / p90 / p99", " / ".join(f"{tt.get(k, 0) * 1000:,.0f} ms" for k in ("mean", "p50", "p90", "p99"))),
        ("prompt tokens", f"{r.prompt_tokens:,}: {r.prefill_computed:,} computed, {r.prefill_saved:,} saved "
                          f"({r.prefill_saved / max(r.prompt_tokens, 1):.1%}; vLLM's num_cached_tokens)"),
        ("saved tokens by source (vLLM)", f"G1 {cached.get('device', 0):,.0f} · G2 {cached.get('host', 0):,.0f} · "
                                          f"volumes {cached.get('disk', 0):,.0f}; external hits {r.vllm_external_hits:,.0f}"),
        ("connector blocks (ours)", f"onboarded G2→G1 {r.kvbm.get('kvbm_onboard_blocks_h2d', 0):,.0f} · "
                                    f"volume→G1 {r.kvbm.get('kvbm_onboard_blocks_d2d', 0):,.0f} · "
                                    f"errors {r.kvbm.get('kvbm_onboard_errors', 0):,.0f}; offloaded G1→G2 "
                                    f"{r.kvbm.get('kvbm_offload_blocks_d2h', 0):,.0f} · G2→volume {r.kvbm.get('kvbm_offload_blocks_h2d', 0):,.0f}"),
        ("onboarded per volume (ours)", onboard_row(r.kvbm)),
        ("G2 resident blocks (ours)", ", ".join(f"{k.split('{')[1].rstrip('}')} {v:,.0f}" for k, v in r.kvbm.items()
                                                 if k.startswith("kvbm_g2_resident_blocks{")) or "-"),
        ("advisor moves", f"{mv.get('promotions', 0):,} promotions · {mv.get('demotions', 0):,} demotions · "
                          f"{mv.get('compactions', 0):,} compactions · {mv.get('bytes_moved', 0):,} B in "
                          f"{mv.get('policy_rounds', 0)} rounds; failed {sum(mv.get('failed', {}).values())}"),
        ("router", f"{r.router_choices.get('router')}: " + ", ".join(f"{k} {v}" for k, v in r.router_choices.get("per_engine", {}).items())
                   + f"; {r.router_choices.get('to_best_overlap', 0)}/{r.router_choices.get('with_overlap', 0)} "
                     f"requests with an overlap sent to the best one ({r.router_choices.get('with_shared_overlap', 0)} "
                     "on a shared volume); "
                     f"{r.router_choices.get('bursts', 0)} bursts routed together (largest "
                     f"{r.router_choices.get('largest_burst', 0)}), routing {r.router_choices.get('route_ms_mean', 0):.1f} ms "
                     f"mean, {r.router_choices.get('route_ms_max', 0):.0f} ms max"),
        ("index == catalog (blocks)", ", ".join(f"{k} {v['index']}/{v['held']}{'' if v['equal'] else ' DIFFERS'}"
                                                for k, v in r.consistency.items() if "equal" in v)),
        ("G1: advisor's fold / indexer's (vLLM events)", ", ".join(
            f"{k} {v['index']}/{v['indexer']}{'' if v['agree'] else ' (copies counted apart)'}"
            for k, v in r.consistency.items() if "agree" in v)),
        ("outputs identical to vLLM without the connector", f"{r.outputs_identical}/{r.outputs_checked}"),
        ("storage namespace (the advisor's)", r.namespace),
        ("wall time", f"{r.wall_s:.0f} s (engines start {r.start_s:.0f} s, replay {r.replay_s:.0f} s)"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t
