"""``kvadvisor status``: the figures an operator checks first, read from a running advisor's
REST API (docs/operations.md, "kvadvisor status").

Shown: health; blocks indexed and per location; ingest (events/s, journal position,
subscriber gaps and drops); sources with epoch, last seq and batches; volumes with usage;
the key namespaces the advisor manages and those the catalog holds blocks in;
moves; lookup hit rates per tier over the last minute, the last hour and since the API
started (``total``: the figures a ``kvadvisor demo`` report gives).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table


class StatusError(RuntimeError):
    """The API could not be read (unreachable, refused the token, answered an error)."""


@dataclass(frozen=True)
class Status:
    """What ``GET /healthz``, ``/v1/stats`` and ``/v1/volumes`` answered."""

    url: str
    health: dict[str, Any]
    stats: dict[str, Any]
    volumes: list[dict[str, Any]]


def fetch_status(url: str, token: str | None = None, timeout_s: float = 10.0) -> Status:
    """Read the status of the advisor whose API is at ``url``.

    Args:
        url: ``http://HOST:PORT`` of the API.
        token: a read (or admin) bearer token, when the API has tokens.
        timeout_s: per request, seconds.

    Raises:
        StatusError: unreachable, or an error answer (its ``error`` code and detail are named).
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as c:
            out = []
            for path in ("/healthz", "/v1/stats", "/v1/volumes"):
                r = c.get(path)
                if r.status_code != 200:
                    try:
                        body = r.json()
                        why = f"{body['error']}: {body['detail']}"
                    except (ValueError, KeyError, TypeError):
                        why = f"HTTP {r.status_code}"
                    raise StatusError(f"{url}{path} answered {r.status_code} ({why})")
                out.append(r.json())
    except httpx.HTTPError as exc:
        why = "connection refused" if isinstance(exc, httpx.ConnectError) and "refused" in str(exc).lower() else (
            f"{type(exc).__name__}: {exc}")
        raise StatusError(f"no advisor API answers at {url} ({why}); pass --url (or set KVADVISOR_URL) to the API "
                          "address `kvadvisor demo` or `kvadvisor up` printed") from None
    return Status(url, out[0], out[1], out[2]["volumes"])


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def print_status(st: Status, console: Console) -> None:
    """Render a :class:`Status` as a few rich tables."""
    s, h = st.stats, st.health
    console.print(f"[bold]advisor[/bold] {st.url}  status [bold]{h.get('status')}[/bold]  journal {h.get('journal_position')}"
                  f"  subscribed {h.get('subscribed')}  storage {h.get('storage')}  up {s.get('uptime_s', 0):.0f} s")
    t = Table(title="index and ingest")
    for col in ("blocks", "orphans pending", "events/s (10 s)", "events applied", "gaps", "dropped"):
        t.add_column(col, justify="right")
    sub = s.get("subscriber", {})
    t.add_row(f"{s['blocks']:,}", f"{s['orphans_pending']:,}", f"{s['events_per_s']:,.0f}", f"{s['events_applied']:,}",
              f"{sub.get('gaps', 0):,}", f"{sub.get('dropped', 0):,}")
    console.print(t)
    t = Table(title="blocks per location")
    t.add_column("location")
    t.add_column("blocks", justify="right")
    for loc, n in sorted(s["blocks_per_location"].items()):
        t.add_row(loc, f"{n:,}")
    console.print(t)
    t = Table(title="sources")
    for col, j in (("source", "left"), ("epoch", "right"), ("last seq", "right"), ("batches", "right"),
                   ("events", "right"), ("last batch (UTC)", "left")):
        t.add_column(col, justify=j)  # type: ignore[arg-type]
    for src, v in sorted(s["sources"].items()):
        ts = v.get("last_ts_ns", 0)
        seen = datetime.fromtimestamp(ts / 1e9, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if ts else "never"
        t.add_row(src, f"{v['epoch']:#018x}", f"{v['last_seq']:,}", f"{v['batches']:,}", f"{v['events']:,}", seen)
    console.print(t)
    t = Table(title="volumes")
    for col in ("id", "role", "kind", "used", "capacity", "indexed blocks"):
        t.add_column(col)
    for v in st.volumes:
        used = v.get("used_bytes")
        t.add_row(v["id"], v["role"], v["kind"], "-" if used is None else f"{used:,}", f"{v['capacity_bytes']:,}",
                  f"{v['indexed_blocks']:,}")
    console.print(t)
    ns = s.get("namespaces") or {}
    if ns:
        managed = set(ns.get("managed", []))
        seen = ns.get("seen", {})
        t = Table(title="key namespaces (a vLLM connector's is its model fingerprint's)")
        for col in ("namespace", "managed", "blocks per volume"):
            t.add_column(col)
        for name in sorted(managed | set(seen)):
            vols = seen.get(name, {})
            t.add_row(name, "yes" if name in managed else "no: add to extra_namespaces",
                      ", ".join(f"{v}={n:,}" for v, n in sorted(vols.items())) or "-")
        console.print(t)
    m = s["moves"]
    console.print(f"moves: {m['promotions']:,} promotions, {m['demotions']:,} demotions, {m['compactions']:,} compactions, "
                  f"{m['bytes_moved']:,} bytes moved, failed {sum(m['failed'].values()):,}")
    t = Table(title="lookup hit rates per tier")
    for col in ("kind", "window", "lookups", "tier", "hit rate", "blocks", "tokens"):
        t.add_column(col)
    for kind, windows in sorted(s.get("hit_rates", {}).items()):
        for w in ("1m", "1h", "total"):
            fig = windows.get(w, {})
            tiers = fig.get("tiers", {}) or {"-": {"hit_rate": 0.0, "blocks": 0, "tokens": 0}}
            for tier, v in tiers.items():
                t.add_row(kind, w, f"{fig.get('lookups', 0):,}", tier, _pct(v["hit_rate"]), f"{v['blocks']:,}",
                          f"{v['tokens']:,}")
    console.print(t)
