"""ZMQ framing shared by publisher and subscriber (same shape as vLLM / SGLang KV events).

Live message (PUB):      ``[topic, seq (8 bytes big-endian), payload]``
Replay request (DEALER): ``[b"", start_seq (8 bytes big-endian)]``; the ROUTER sees
                         ``[identity, b"", start_seq]``.
Replay reply (ROUTER):   ``[identity, b"", topic, seq, payload]`` per buffered batch with
                         seq >= start_seq, then the end marker
                         ``[identity, b"", topic, END_SEQ, b""]``.
Sources: ``docs/events.md`` §6 and §10.
"""

from __future__ import annotations

END_SEQ = b"\xff" * 8
"""Seq frame of the replay end marker (all 0xFF)."""

SEQ_BYTES = 8


def seq_to_bytes(seq: int) -> bytes:
    """Encode a batch seq (u64) as the 8-byte big-endian seq frame."""
    return seq.to_bytes(SEQ_BYTES, "big")


def seq_from_bytes(frame: bytes) -> int:
    """Decode an 8-byte big-endian seq frame.

    Raises:
        ValueError: the frame is not exactly 8 bytes.
    """
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"seq frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")
