"""``kvadvisor demo --scaled``: replay a trace through the topology ``kvadvisor up`` started.

Workers (``kvbm_runtime.BlockManager`` with G1/G2 pools, G3 on the topology's ``slow`` POSIX
volume, the ``fast`` and ``s3`` volumes readable, placement catalog in Redis: the volumes of
the advisors' ``storage.json``) publish through
:class:`event_plane.partitioned.PartitionedPublisher` to the NATS JetStream cluster; the
cluster advisors fold each partition and move blocks between the volumes; the demo then
checks, as the embedded demo does, that the index (the union of every partition, asked
through :class:`advisor.cluster.node.ClusterClient`) equals what each worker holds in G1/G2 and
what the catalog places on each volume (once the movers' announcements are folded: it asks
again, up to ``settle_s``, while they differ), and reads every stored block back byte for
byte.
"""

from __future__ import annotations

import dataclasses
import random
import secrets
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from advisor.cluster.node import ClusterClient, PartitionUnavailable
from advisor.cluster.mover import ClusterStorageSettings
from advisor.cluster.query import ClusterQuery
from event_plane.partition import PartitionScheme
from event_plane.partitioned import PartitionedPublisher, partition_url
from event_plane.urls import make_publisher
from kvadvisor.demo import FAST, S3, SLOW, DemoError, DemoReport, _volumes, read_back, runtime_config, size_tiers
from kvadvisor.settings import DemoSettings
from kvadvisor.trace import bundled_trace, read_mooncake, request_tokens
from kvadvisor.up import ClusterUp, load, worker_nats_url
from kvbm_runtime import BlockManager, fill_synthetic_kv
from storage_backends import StorageAgent
from storage_backends.redis_catalog import RedisCatalog

__all__ = ["run_scaled_demo"]


def _wait_caught_up(client: ClusterClient, pubs: list[PartitionedPublisher], timeout_s: float = 120.0) -> dict[int, Any]:
    """Block until every partition applied every batch the workers sent it.

    Raises:
        DemoError: on timeout, naming the partitions still behind.
    """
    want = {(k, p.source): (p.epoch, inner.stats().batches - 1)
            for p in pubs for k, inner in enumerate(p.publishers)}
    end = time.monotonic() + timeout_s
    behind: dict[Any, Any] = {}
    while time.monotonic() < end:
        try:
            status = client.status()
        except PartitionUnavailable as exc:
            behind = {"unavailable": str(exc)}
            time.sleep(0.2)
            continue
        behind = {}
        for (k, src), (epoch, seq) in want.items():
            if seq < 0:
                continue
            got = status[k]["sources"].get(src)
            if not (got and int(got[0]) == epoch and int(got[1]) >= seq):
                behind[(k, src)] = (got, seq)
        if not behind:
            return status
        time.sleep(0.1)
    raise DemoError(f"the cluster did not catch up within {timeout_s} s: {behind}")


def _mover_events(status: dict[int, Any]) -> int:
    """Events the partitions applied from the cluster movers (sources ``<advisor id>-mover``)."""
    return sum(int(fig[1]) for st in status.values() for name, fig in st.get("source_figures", {}).items()
               if name.endswith("-mover"))


def _moves_so_far(status: dict[int, Any]) -> dict[str, dict[str, int]]:
    """The movers' results summed over partitions (``ClusterMover.partition_moves``)."""
    out: dict[str, dict[str, int]] = {"done": {}, "skipped": {}, "failed": {}, "bytes_moved": {}}
    for st in status.values():
        for field_name, table in out.items():
            for kind, n in st.get("moves", {}).get(field_name, {}).items():
                table[kind] = table.get(kind, 0) + int(n)
    return out


def _rounds(status: dict[int, Any]) -> dict[int, int] | None:
    """Policy rounds per partition since its owner took it, ``None`` when a partition's owner
    runs no mover (nothing to wait for)."""
    out = {}
    for p, st in status.items():
        n = st.get("moves", {}).get("rounds", {}).get("policy")
        if n is None:
            return None
        out[p] = int(n)
    return out


def _settle_moves(client: ClusterClient, status: dict[int, Any], timeout_s: float) -> dict[int, Any]:
    """Wait until the movers are done with what the replay left them: a quiet period in which
    every partition ran two policy rounds (so one began inside it) and no move result was
    added, after two rounds that began after the replay.  Returns the last status (the one
    the report reads its moves and sources from: ``/v1/stats`` sums the same answers); past
    ``timeout_s`` (movers still busy, a take-over) the last status as it is."""
    base = _rounds(status)
    if base is None:
        return status
    end = time.monotonic() + timeout_s
    mark: tuple[dict[int, int], int] | None = None

    def results(st: dict[int, Any]) -> int:
        m = _moves_so_far(st)
        return sum(sum(m[k].values()) for k in ("done", "skipped", "failed"))

    while time.monotonic() < end:
        try:
            now = client.status()
        except PartitionUnavailable:
            time.sleep(0.5)
            continue
        status = now
        rounds = _rounds(now)
        if rounds is None:
            return now
        if any(rounds[p] < base.get(p, 0) for p in rounds):  # an owner changed: count again
            base, mark = rounds, None
        elif mark is None:
            if all(rounds[p] >= base.get(p, 0) + 2 for p in rounds):
                mark = (rounds, results(now))
        elif all(rounds[p] >= mark[0].get(p, 0) + 2 for p in rounds):
            if results(now) == mark[1]:
                return now
            mark = (rounds, results(now))
        time.sleep(0.5)
    return status


def _sources(pubs: list[PartitionedPublisher], status: dict[int, Any]) -> dict[str, dict[str, int]]:
    """Per source, the batches and events of this run: each worker's as its publishers
    counted them (every partition's), each cluster mover's (``<advisor id>-mover``) as the
    partitions applied them."""
    out: dict[str, dict[str, int]] = {}
    for p in pubs:
        st = [inner.stats() for inner in p.publishers]
        out[p.source] = {"batches": sum(x.batches for x in st), "events": sum(x.events for x in st)}
    for part in status.values():
        for name, fig in part.get("source_figures", {}).items():
            if name.endswith("-mover"):
                cur = out.setdefault(name, {"batches": 0, "events": 0})
                cur["batches"] += int(fig[0])
                cur["events"] += int(fig[1])
    return dict(sorted(out.items()))


def _volumes_agree(client: ClusterClient, agent: StorageAgent, volumes: tuple[str, ...],
                   settle_s: float) -> dict[str, Any]:
    """Per volume, the blocks the index places there against those the catalog does:
    ``{volume: {"index", "held", "equal"}}``.  While the movers' announcements are still on
    their way the two differ; they are asked again (every 0.5 s, up to ``settle_s``) until
    every volume agrees, and the last answer is returned."""
    end = time.monotonic() + settle_s
    while True:
        out: dict[str, Any] = {}
        for v in volumes:
            held = {p.key.sequence_hash for p in agent.catalog.iter_volume(v)}
            idx = client.blocks_at(v)
            out[v] = {"index": len(idx), "held": len(held), "equal": idx == held}
        if all(x["equal"] for x in out.values()) or time.monotonic() >= end:
            return out
        time.sleep(0.5)


def run_scaled_demo(s: DemoSettings, cluster_dir: Path,
                    progress: Callable[[int, int], None] | None = None, settle_s: float = 60.0) -> DemoReport:
    """Replay ``s.requests`` requests through the running scaled topology.

    Raises:
        UpError: no topology under ``cluster_dir``.
        DemoError: the cluster does not catch up, or a partition stays without an owner.
    """
    t0 = time.monotonic()
    state: ClusterUp = load(cluster_dir)
    reqs = list(read_mooncake(s.trace or bundled_trace(), limit=s.requests))
    if not reqs:
        raise DemoError("the trace has no requests")
    s = size_tiers(s, reqs)
    run = secrets.token_hex(3)
    workdir = Path(state.root) / f"demo-{run}"
    scheme = PartitionScheme(state.partitions)
    s = s.model_copy(update={"s3_bucket": state.s3_bucket})
    shared = ClusterStorageSettings.load(state.storage) if state.storage else None
    volumes = (FAST, SLOW, S3) if shared is not None else (SLOW, S3)
    with ExitStack() as stack:
        if shared is not None:  # the advisors' catalog and volumes: their movers manage these blocks
            agent = StorageAgent(RedisCatalog(state.redis_url, prefix=shared.catalog_prefix), name="demo-workers",
                                 allowed_roots=shared.volume_roots)
            stack.callback(agent.close)
            for vs in shared.volumes:
                agent.register_volume(vs.to_descriptor())
        else:
            agent = StorageAgent(RedisCatalog(state.redis_url, prefix=f"kvadvisor:{state.namespace}:catalog:{run}"),
                                 name="demo-workers")
            stack.callback(agent.close)
            for v in _volumes(s, workdir, state.s3_endpoint, state.s3_access_key, state.s3_secret_key):
                if v.id in (SLOW, S3):
                    # each run its own object prefix: runs sharing the topology's bucket never overwrite
                    agent.register_volume(dataclasses.replace(v, prefix=f"kv-{run}") if v.id == S3 else v)
        query = f"?namespace={state.namespace}&replicas={state.replicas}"
        url = f"jetstream://{state.nats_urls[0].split('://', 1)[1]}{query}"  # no credentials: for the report
        rcfg = runtime_config(s)
        pubs: list[PartitionedPublisher] = []
        managers: list[BlockManager] = []
        for i in range(s.workers):
            epoch = random.getrandbits(63)
            src = f"worker-{run}-{i}"
            # each worker as its own NATS user: it may publish its own subject only (docs/security.md)
            mine = f"jetstream://{worker_nats_url(state, src).split(',')[0].split('://', 1)[1]}{query}"
            pub = PartitionedPublisher(scheme, lambda k, src=src, e=epoch, u=mine: make_publisher(partition_url(u, k), src,
                                                                                                 epoch=e))
            stack.callback(pub.close)
            pubs.append(pub)
            mgr = BlockManager(rcfg, pub, store=agent, g3_volume=SLOW)  # type: ignore[arg-type]
            stack.callback(mgr.close)
            managers.append(mgr)
        client = ClusterClient(state.advisor_nats_url, scheme, state.namespace, timeout_s=5.0)
        stack.callback(client.close)
        report = DemoReport(requests=len(reqs), workers=s.workers, api_url=state.api_url,
                            event_urls=[url], transport="jetstream (partitioned)")
        t_replay = time.monotonic()
        try:
            before = client.status()
        except PartitionUnavailable:  # a take-over under way: counted from zero
            before = {}
        movers_before, moves_before = _mover_events(before), _moves_so_far(before)
        sources_before = _sources([], before)
        for n, req in enumerate(reqs, 1):
            mgr = managers[(n - 1) % s.workers]
            report.add_served(mgr.serve(request_tokens(req, s.page_size), fill_synthetic_kv))
            if progress:
                progress(n, len(reqs))
        for p in pubs:
            p.flush()
        status = _wait_caught_up(client, pubs)
        caught_up_s = time.monotonic() - t_replay
        stats = [inner.stats() for p in pubs for inner in p.publishers]
        report.worker_events = sum(st.events for st in stats)
        report.advisor_events_per_s = report.worker_events / caught_up_s if caught_up_s > 0 else 0.0
        report.ingest_basis = "cluster: worker events / s, first request to every partition caught up"
        report.batches = sum(st.batches for st in stats)
        ev = max(report.worker_events, 1)
        report.event_bytes_per_event = sum(st.event_bytes for st in stats) / ev
        report.payload_bytes_per_event = sum(st.payload_bytes for st in stats) / ev
        # the movers act on the replay in their next policy rounds: the report's moves, the
        # movers' events and the sources are read once they are done (and folded, below), so
        # they are what GET /v1/stats and `kvadvisor status --url` show afterwards
        status = _settle_moves(client, status, 2 * settle_s)
        verified: dict[str, Any] = {}
        for mgr in managers:
            src = mgr.publisher.source
            for tier in ("g1", "g2"):
                held = mgr.resident(tier)
                idx = client.blocks_at(f"{src}/{tier}")
                verified[f"{src}/{tier}"] = {"index": len(idx), "held": len(held), "equal": idx == held}
        verified.update(_volumes_agree(client, agent, volumes, settle_s))
        try:  # the movers' announcements are folded now (index == catalog on the volumes)
            status = client.status()
        except PartitionUnavailable:
            pass
        # the cluster movers' own Store/Remove events during this run (sources "<advisor>-mover")
        report.advisor_events = max(0, _mover_events(status) - movers_before)
        report.events = report.worker_events + report.advisor_events
        report.index_blocks = {f"partition {k}": int(v["blocks"]) for k, v in sorted(status.items())}
        moved = _moves_so_far(status)  # the cluster advisors' movers, every partition, this run
        delta = {f: {k: moved[f].get(k, 0) - moves_before[f].get(k, 0) for k in ("promote", "demote", "compact")}
                 for f in moved}
        report.promotions, report.demotions, report.compactions = (delta["done"][k]
                                                                   for k in ("promote", "demote", "compact"))
        report.bytes_moved = sum(delta["bytes_moved"].values())
        report.failed_moves = delta["failed"]
        report.sources = {name: {k: v - sources_before.get(name, {}).get(k, 0) for k, v in fig.items()}
                          for name, fig in _sources(pubs, status).items()}
        try:
            report.volumes = [dataclasses.asdict(v) for v in ClusterQuery(client).volumes()]
        except PartitionUnavailable:
            report.volumes = []
        checked, ok, failures = read_back(agent, s)
        verified["bytes_checked"], verified["bytes_ok"] = checked, ok
        if failures:
            verified["unreadable"] = failures[:10]
        report.verified = verified
        report.wall_s = time.monotonic() - t0
        return report
