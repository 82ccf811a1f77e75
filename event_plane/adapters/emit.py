"""Emit vLLM- or SGLang-shaped KV events over real ZMQ sockets, without vLLM or SGLang.

For tests, benchmarks and vendors who want to try an adapter against a known stream. The
shapes follow ``docs/events.md`` §10 (our own encoder; nothing is
imported from the peers):

* live: PUB multipart ``[topic, seq (8 bytes big-endian), payload]``;
* payload: MessagePack ``[ts: float, events, dp_rank]`` (``dp_rank`` left out when ``None``);
* events in array form ``[tag, fields...]`` (trailing ``None`` fields left out, down to the
  fields every release sends) or map form ``{"type": tag, field: value}`` (``None`` fields
  left out);
* replay: a ROUTER answering ``[identity, b"", start_seq]`` with every buffered batch with
  seq ≥ start, as ``[identity, b"", topic, seq, payload]`` (vLLM ≥ 0.26) or ``[identity,
  b"", seq, payload]`` (older vLLM, SGLang), then the end marker (seq = 8 × 0xFF, empty
  payload, topic frame too in the first shape).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import zmq

from event_plane.adapters.peer import CLEARED, REMOVED, STORED
from event_plane.adapters.sglang import SGLANG_FIELDS
from event_plane.adapters.vllm import VLLM_FIELDS
from event_plane.errors import ConfigError, TransportError
from event_plane.frames import END_SEQ, SEQ_BYTES, seq_from_bytes, seq_to_bytes

Flavor = Literal["vllm", "sglang"]
Form = Literal["array", "map"]

_FIELDS = {"vllm": VLLM_FIELDS, "sglang": SGLANG_FIELDS}
# Fields every release sends in array form (after the tag); later ones are trimmed when None.
_MIN_FIELDS = {STORED: 6, REMOVED: 2, CLEARED: 0}
_LEGACY_FIELDS = {STORED: 5, REMOVED: 1, CLEARED: 0}  # releases before ``medium`` existed

_encoder = msgspec.msgpack.Encoder()


def peer_event(
    tag: str, values: dict[str, Any], *, flavor: Flavor = "vllm", form: Form = "array", legacy: bool = False
) -> list[Any] | dict[str, Any]:
    """One peer event as a MessagePack-ready value.

    Args:
        tag: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (or any other, for
            unknown-kind tests; its array form is ``[tag]``).
        values: field name → value (names as in ``VLLM_FIELDS`` / ``SGLANG_FIELDS``).
        flavor: field order to use for the array form.
        form: ``"array"`` (tag first) or ``"map"`` (``"type"`` key).
        legacy: array form of releases without ``medium`` (fields after ``lora_id`` /
            ``block_hashes`` dropped).

    Raises:
        ConfigError: unknown flavor / form.
    """
    if flavor not in _FIELDS or form not in ("array", "map"):
        raise ConfigError(f"unknown peer flavor/form {flavor!r}/{form!r}")
    if form == "map":
        return {"type": tag, **{k: v for k, v in values.items() if v is not None}}
    names = _FIELDS[flavor].get(tag, ())
    row = [values.get(name) for name in names]
    if legacy:
        row = row[: _LEGACY_FIELDS.get(tag, 0)]
    keep = _LEGACY_FIELDS.get(tag, 0) if legacy else _MIN_FIELDS.get(tag, 0)
    while len(row) > keep and row[-1] is None:
        row.pop()
    return [tag, *row]


def peer_batch(events: Sequence[Any], ts: float | None = None, dp_rank: int | None = None) -> bytes:
    """Encode a peer batch ``[ts, events, dp_rank?]`` (``ts`` defaults to now, seconds)."""
    body: list[Any] = [time.time() if ts is None else ts, list(events)]
    if dp_rank is not None:
        body.append(dp_rank)
    return _encoder.encode(body)


class PeerEmitter:
    """A stand-in for a vLLM / SGLang KV-event publisher on real ZMQ sockets.

    Args:
        endpoint: PUB bind address (``tcp://127.0.0.1:PORT``).
        replay_endpoint: ROUTER bind address, or ``None``.
        flavor: ``"vllm"`` or ``"sglang"`` (field order; default reply shape).
        form: ``"array"`` or ``"map"`` events.
        topic: topic frame of live messages.
        reply_topic: replay replies carry the topic frame (default: ``True`` for vLLM,
            ``False`` for SGLang).
        buffer: batches kept for replay.
        legacy: array form without ``medium`` (old releases).

    Raises:
        TransportError: an endpoint cannot be bound.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        flavor: Flavor = "vllm",
        form: Form = "array",
        topic: bytes = b"",
        reply_topic: bool | None = None,
        buffer: int = 10_000,
        legacy: bool = False,
        context: zmq.Context | None = None,
    ) -> None:
        if flavor not in _FIELDS or form not in ("array", "map"):
            raise ConfigError(f"unknown peer flavor/form {flavor!r}/{form!r}")
        self.flavor, self.form, self.legacy = flavor, form, legacy
        self.topic = bytes(topic)
        self.reply_topic = (flavor == "vllm") if reply_topic is None else reply_topic
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self._pub.bind(endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            raise TransportError(f"cannot bind PUB to {endpoint}: {exc}") from exc
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.next_seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            try:
                router.bind(replay_endpoint)
            except zmq.ZMQError as exc:
                router.close(linger=0)
                self._pub.close(linger=0)
                raise TransportError(f"cannot bind ROUTER to {replay_endpoint}: {exc}") from exc
            self._thread = threading.Thread(target=self._serve, args=(router,), name="peer-emitter-replay", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ events
    def stored(
        self,
        block_hashes: Sequence[int | bytes],
        parent_block_hash: int | bytes | None,
        *,
        block_size: int = 16,
        token_ids: Sequence[int] | None = None,
        medium: str | None = "GPU",
        lora_id: int | None = None,
        lora_name: str | None = None,
        group_idx: int | None = None,
    ) -> Any:
        """A ``BlockStored`` event in this emitter's form (``token_ids`` default: zeros)."""
        tokens = list(token_ids) if token_ids is not None else [0] * (block_size * len(block_hashes))
        values = {
            "block_hashes": list(block_hashes),
            "parent_block_hash": parent_block_hash,
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": lora_id,
            "medium": medium,
            "lora_name": lora_name,
            "group_idx": group_idx,
        }
        return peer_event(STORED, values, flavor=self.flavor, form=self.form, legacy=self.legacy)

    def removed(self, block_hashes: Sequence[int | bytes], medium: str | None = "GPU") -> Any:
        """A ``BlockRemoved`` event in this emitter's form."""
        values = {"block_hashes": list(block_hashes), "medium": medium}
        return peer_event(REMOVED, values, flavor=self.flavor, form=self.form, legacy=self.legacy)

    def cleared(self) -> Any:
        """An ``AllBlocksCleared`` event in this emitter's form."""
        return peer_event(CLEARED, {}, flavor=self.flavor, form=self.form, legacy=self.legacy)

    # ------------------------------------------------------------------ sending
    def send(self, events: Sequence[Any], *, ts: float | None = None, dp_rank: int | None = None) -> int:
        """Publish one batch of ``events``; returns its seq."""
        return self.send_payload(peer_batch(events, ts, dp_rank))

    def send_payload(self, payload: bytes, *, live: bool = True) -> int:
        """Publish ``payload`` as the next batch (``live=False``: only buffer it for replay,
        as if the live message were lost); returns its seq."""
        with self._lock:
            seq = self.next_seq
            self.next_seq += 1
            self._buffer.append((seq, payload))
            if live:
                self._pub.send_multipart([self.topic, seq_to_bytes(seq), payload])
        return seq

    def restart(self) -> None:
        """Behave like a restarted process: seq back to 0, replay buffer emptied."""
        with self._lock:
            self.next_seq = 0
            self._buffer.clear()

    def close(self) -> None:
        """Stop the replay thread and close the sockets. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not self._pub.closed:
            self._pub.close()

    def __enter__(self) -> PeerEmitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
                envelope, rest = frames[:1], frames[1:]
                if rest and rest[0] == b"":
                    envelope.append(b"")
                    rest = rest[1:]
                head = [self.topic] if self.reply_topic else []
                if len(rest) == 1 and len(rest[0]) == SEQ_BYTES:
                    start = seq_from_bytes(rest[0])
                    with self._lock:
                        hits = [(s, p) for s, p in self._buffer if s >= start]
                    for s, p in hits:
                        router.send_multipart([*envelope, *head, seq_to_bytes(s), p])
                router.send_multipart([*envelope, *([b""] if self.reply_topic else []), END_SEQ, b""])
        finally:
            router.close(linger=0)
