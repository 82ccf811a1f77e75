"""``kvadvisor events ...``: watch an event stream from the command line.

* ``tail URL``: every event as one JSON line ``{"source", "epoch", "seq", "index", "type",
  "sequence_hash", "prefix_hash", "parent_hash", "block_size", "storage_location",
  "extra_metadata"}``; a gap the subscriber detected prints ``{"gap": {"source", "epoch",
  "first", "last"}}`` just before the first batch after it (recovered batches, if any,
  follow the marker). Stops after ``--count`` events or ``--duration`` seconds. When nothing
  answered at the URL within ``--connect-timeout`` seconds (no batch, no replay answer, no
  server), it says so on stderr and keeps waiting; when ``--duration`` ends with nothing
  received from an endpoint that never answered, it exits with status 1.
* ``stats URL --duration S``: one JSON object with events/s, batches/s, bytes per event (of
  the KVEvent v1 encoding), gaps, replayed, unrecovered, drops, decode errors, restarts.
  When no batch arrived and the endpoint never answered, it prints no report: a message on
  stderr and exit status 1 (zeros would read as an idle stream).
* ``relay SRC DST``: publish every batch read from SRC again to the publisher URL DST, one
  publisher per source (a vLLM or SGLang engine's ZMQ events into a partitioned JetStream
  cluster: ``vllm+zmq://…`` to ``jetstream://…?namespace=NS&partitions=P``); ends with one
  JSON line of counts. NATS credentials of DST: its own (``password_file=`` in the URL), else
  ``--password-file`` or ``$KVADVISOR_NATS_PASSWORD_FILE`` (a file ``kvadvisor nats
  add-worker`` wrote): never a password on the command line.
* ``keygen DIR [--name NAME]``: write a new CURVE keypair, ``DIR/NAME.key`` (public, give
  it to the other side) and ``DIR/NAME.key_secret`` (mode 0600, keep it), in the ZeroMQ
  certificate format (:func:`event_plane.curve.keygen`); prints the public key's path and
  the public key (Z85), never the secret one.

URLs: anything :func:`event_plane.subscribe` takes (``zmq://``, ``nats://``,
``jetstream://``, ``vllm+zmq://``, ``sglang+zmq://``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from event_plane.codec import encode_batch
from event_plane.errors import ConfigError, EventPlaneError
from event_plane.nats_auth import PASSWORD_FILE_ENV, NatsAuth, redact_url
from event_plane.partitioned import close_all
from event_plane.schema import EventBatch, EventType, KVEvent
from event_plane.urls import make_publisher, nats_connection, subscribe

events_app = typer.Typer(no_args_is_help=True, help="Watch KV-event streams (tail, stats), relay them (relay); CURVE keys (keygen).")

_TYPE_NAMES = {EventType.STORE: "store", EventType.REMOVE: "remove", EventType.CLEARED: "cleared"}


def event_json(batch: EventBatch, index: int, ev: KVEvent) -> dict[str, Any]:
    """JSON-ready dict of one event with its batch coordinates (see module docstring)."""
    return {
        "source": batch.source,
        "epoch": batch.epoch,
        "seq": batch.seq,
        "index": index,
        "type": _TYPE_NAMES.get(ev.type, int(ev.type)),
        "sequence_hash": ev.sequence_hash,
        "prefix_hash": ev.prefix_hash,
        "parent_hash": ev.parent_hash,
        "block_size": ev.block_size,
        "storage_location": ev.storage_location,
        "extra_metadata": ev.extra_metadata,
    }


class _GapMarkers:
    """Gaps reported by the subscriber thread, printed before the first batch after them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[str, int, int, int]] = []

    def __call__(self, source: str, epoch: int, first: int, last: int) -> None:
        with self._lock:
            self._pending.append((source, epoch, first, last))

    def due(self, batch: EventBatch) -> list[dict[str, Any]]:
        """Markers to print before ``batch`` (a gap of its source/epoch starting at or
        before its seq)."""
        out: list[dict[str, Any]] = []
        with self._lock:
            keep = []
            for source, epoch, first, last in self._pending:
                if source == batch.source and epoch == batch.epoch and first <= batch.seq:
                    out.append({"gap": {"source": source, "epoch": epoch, "first": first, "last": last}})
                else:
                    keep.append((source, epoch, first, last))
            self._pending = keep
        return out


def _nothing_answered(command: str, url: str, seconds: float) -> str:
    return (f"kvadvisor events {command}: nothing answered at {redact_url(url)} in {seconds:.3g} s "
            "(no batch, no replay answer; is a publisher running there?)")


def _open(url: str, **kw: Any) -> Any:
    try:
        sub = subscribe(url, **kw)
        sub.start()
    except EventPlaneError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    return sub


def _read_until(sub: Any, deadline: float | None) -> Iterator[EventBatch | None]:
    """``sub``'s batches as they come, ``None`` after each 0.2 s without one, until the
    monotonic ``deadline`` (``None``: until the caller stops)."""
    while True:
        wait = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
        if wait <= 0:
            return
        yield sub.get(timeout=wait)


@events_app.command()
def tail(
    url: Annotated[str, typer.Argument(help="event URL, e.g. zmq://127.0.0.1:5557?replay=5558")],
    count: Annotated[Optional[int], typer.Option("--count", "-n", min=1, help="stop after N events")] = None,
    duration: Annotated[Optional[float], typer.Option("--duration", "-d", min=0.001, help="stop after S seconds")] = None,
    connect_timeout: Annotated[
        float, typer.Option("--connect-timeout", min=0.001, help="warn on stderr when nothing answered after S seconds")
    ] = 5.0,
) -> None:
    """Print every event as a JSON line, with gap markers."""
    gaps = _GapMarkers()
    t0 = time.monotonic()
    sub = _open(url, on_gap=gaps)
    printed = 0
    warned = False
    deadline = None if duration is None else t0 + duration
    try:
        for batch in _read_until(sub, deadline):
            if batch is None:
                if not warned and not sub.answered and time.monotonic() - t0 >= connect_timeout:
                    typer.echo(_nothing_answered("tail", url, connect_timeout) + "; still waiting", err=True)
                    warned = True
                continue
            for marker in gaps.due(batch):
                typer.echo(json.dumps(marker))
            for i, ev in enumerate(batch.events):
                typer.echo(json.dumps(event_json(batch, i, ev)))
                printed += 1
                if count is not None and printed >= count:
                    break
            if count is not None and printed >= count:
                break
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
    if printed == 0 and not sub.answered:
        typer.echo(_nothing_answered("tail", url, time.monotonic() - t0), err=True)
        raise typer.Exit(1)


@events_app.command()
def stats(
    url: Annotated[str, typer.Argument(help="event URL")],
    duration: Annotated[float, typer.Option("--duration", "-d", min=0.001, help="seconds to measure")] = 10.0,
) -> None:
    """Measure a stream for DURATION seconds; print rates and sizes as one JSON object."""
    sub = _open(url)
    batches = events = wire_bytes = 0
    t0 = time.monotonic()
    deadline = t0 + duration
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            batch = sub.get(timeout=min(0.2, left))
            if batch is None:
                continue
            batches += 1
            events += len(batch.events)
            wire_bytes += len(encode_batch(batch))
    except KeyboardInterrupt:
        pass
    finally:
        elapsed = max(time.monotonic() - t0, 1e-9)
        sub.close()
    st = sub.stats()
    if batches == 0 and not sub.answered:
        typer.echo(_nothing_answered("stats", url, elapsed), err=True)
        raise typer.Exit(1)
    report = {
        "url": url,
        "seconds": round(elapsed, 3),
        "batches": batches,
        "events": events,
        "events_per_s": round(events / elapsed, 1),
        "batches_per_s": round(batches / elapsed, 1),
        "bytes_per_event": round(wire_bytes / events, 2) if events else None,
        "gaps": st.gaps,
        "replayed": st.replayed,
        "unrecovered": st.unrecovered,
        "drops": st.dropped,
        "decode_errors": st.decode_errors,
        "duplicates": st.duplicates,
        "restarts": st.restarts,
    }
    typer.echo(json.dumps(report))


@events_app.command()
def relay(
    src: Annotated[str, typer.Argument(help="event URL to read, e.g. 'vllm+zmq://127.0.0.1:5557?replay=5558&source=pod-a'")],
    dst: Annotated[str, typer.Argument(help="publisher URL, e.g. 'jetstream://127.0.0.1:4222?namespace=NS&partitions=8'")],
    duration: Annotated[Optional[float], typer.Option("--duration", "-d", min=0.001, help="stop after S seconds")] = None,
    count: Annotated[Optional[int], typer.Option("--count", "-n", min=1, help="stop after N events")] = None,
    max_sources: Annotated[int, typer.Option("--max-sources", min=1, help="publishers held at once (one per source); "
                                             "batches of further sources are skipped and counted")] = 256,
    password_file: Annotated[Optional[Path], typer.Option(
        "--password-file", envvar=PASSWORD_FILE_ENV, show_default=False,
        help="NATS password file of DST (mode 0600; `kvadvisor nats add-worker` writes one), unless DST "
             "carries credentials")] = None,
) -> None:
    """Publish every batch read from SRC again to DST, one publisher per source.

    This is how a vLLM or SGLang engine's own ZMQ KV events reach a scaled cluster: the
    adapter URL (``vllm+zmq://``, ``sglang+zmq://``) turns them into KVEvent v1 batches, and
    a ``partitions=P`` publisher URL routes each event to its partition's namespace
    (docs/scaling.md).  A source's new epoch (an engine restart) gets a new publisher with
    that epoch.  Each publisher holds a connection and a thread, so at most
    ``--max-sources`` are held: a batch of a further source is skipped (``refused_sources``
    counts them). A source name the destination cannot carry (not a NATS subject token) is
    skipped alone (``bad_sources``); a destination that cannot be reached ends the relay
    (status 2).  Ends with one JSON line: batches, events, sources, the source side's
    unrecovered gaps, the publishers' dropped events and those skipped batches.

    A NATS worker user (docs/security.md) may publish its own source only: relay one
    engine (``source=`` of its adapter URL) per worker user.  A NATS destination's
    credentials are checked before anything is read: a password file that cannot be read,
    or that group or others may read, ends the relay at once (status 2).
    """
    nats_auth = NatsAuth(password_file=str(password_file)) if password_file is not None else None
    if dst.split("://", 1)[0].lower() in ("nats", "tls", "jetstream"):
        try:
            nats_connection(dst, nats_auth)  # reads the credential files; connects nowhere
        except EventPlaneError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
    sub = _open(src)
    pubs: dict[str, Any] = {}
    epochs: dict[str, int] = {}
    bad: set[str] = set()  # names refused by the destination (at most max_sources remembered)
    batches = events = dropped = refused = bad_batches = 0
    deadline = None if duration is None else time.monotonic() + duration
    idle = False
    try:
        for batch in _read_until(sub, deadline):
            if batch is None:
                if not idle:  # nothing new: send what is buffered
                    for pub in pubs.values():
                        pub.flush()
                    idle = True
                continue
            idle = False
            pub = pubs.get(batch.source)
            if pub is not None and epochs[batch.source] != batch.epoch:
                pub.close()  # what close still sends or drops is in the stats read after it
                dropped += pub.stats().dropped
                pub = None
            if pub is None:
                if batch.source in bad:
                    bad_batches += 1
                    continue
                if len(pubs) >= max_sources and batch.source not in pubs:
                    refused += 1
                    if refused == 1:
                        typer.echo(f"warning: more than {max_sources} sources; batches of further ones are skipped",
                                   err=True)
                    continue
                pubs.pop(batch.source, None)
                try:
                    pub = make_publisher(dst, batch.source, epoch=batch.epoch, nats_auth=nats_auth)
                except ConfigError as exc:  # this source's name, not the destination
                    bad_batches += 1
                    if len(bad) < max_sources:
                        bad.add(batch.source)
                    typer.echo(f"warning: batch of {batch.source[:64]!r} skipped: {exc}", err=True)
                    continue
                except EventPlaneError as exc:
                    typer.echo(f"error: {exc}", err=True)
                    raise typer.Exit(2) from exc
                pubs[batch.source], epochs[batch.source] = pub, batch.epoch
            pub.publish(list(batch.events))
            batches += 1
            events += len(batch.events)
            if count is not None and events >= count:
                break
    except KeyboardInterrupt:
        pass
    finally:
        try:
            close_all(list(pubs.values()))  # every publisher closed even if one raises
        finally:
            sub.close()
    dropped += sum(pub.stats().dropped for pub in pubs.values())
    typer.echo(json.dumps({"src": redact_url(src), "dst": redact_url(dst), "batches": batches, "events": events,
                           "sources": len(pubs), "unrecovered": sub.stats().unrecovered, "dropped": dropped,
                           "refused_sources": refused, "bad_sources": bad_batches}))


@events_app.command()
def keygen(
    directory: Annotated[Path, typer.Argument(help="directory to write NAME.key and NAME.key_secret into")],
    name: Annotated[str, typer.Option("--name", help="file name of the keypair")] = "kvadvisor",
) -> None:
    """Write a CURVE keypair for ZMQ event sockets (public NAME.key, secret NAME.key_secret, mode 0600)."""
    from event_plane.curve import keygen as write_keypair, load_public

    try:
        public_path, secret_path = write_keypair(directory, name)
    except (ConfigError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(json.dumps({"public_file": str(public_path), "secret_file": str(secret_path),
                           "public_key": load_public(str(public_path)).decode()}))
