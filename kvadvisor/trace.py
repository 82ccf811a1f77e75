"""Readers for public KV-cache block-reuse traces, and token synthesis for replays.

Formats (see ``kvadvisor/data/ATTRIBUTION.md`` and docs/traces.md):

* Mooncake FAST'25 jsonl: one request per line, ``{"timestamp": ms, "input_length": tokens,
  "output_length": tokens, "hash_ids": [...]}``; ``hash_ids`` are prefix-chained ids of
  512-token blocks, the last block may be partial.

A trace carries block *ids*, not tokens.  To drive a real runtime (which hashes tokens,
docs/design.md §4) each id is expanded into a deterministic pseudo-random token block, so that
equal ids give equal tokens and therefore equal sequence hashes at equal positions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512
VOCAB_SIZE = 32_000


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival time from trace start, in milliseconds.
        input_length: prompt length in tokens.
        output_length: generated tokens.
        hash_ids: prefix-chained block ids, ``ceil(input_length / block_tokens)`` of them.
    """

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceFormatError(ValueError):
    """A trace line is not valid for its format (the message names file and line)."""


def bundled_trace() -> Path:
    """Path of the Mooncake slice shipped with the package (2,000 requests)."""
    return Path(str(resources.files("kvadvisor") / "data" / "mooncake_conversation_2000.jsonl"))


def read_mooncake(path: str | Path, limit: int | None = None) -> Iterator[TraceRequest]:
    """Yield requests of a Mooncake jsonl trace, at most ``limit`` of them.

    Raises:
        TraceFormatError: ``path`` is a directory or not text, or a line is not a JSON object
            with the four fields (the message names the file, the line and the WEKA reader).
        FileNotFoundError: if ``path`` does not exist.
    """
    if Path(path).is_dir():
        raise TraceFormatError(f"{path} is a directory, not a Mooncake jsonl file (a WEKA trace?); "
                               f"`kvadvisor evaluate --trace {path} --format weka` reads WEKA traces")
    with open(path, encoding="utf-8") as fh:
        n = 0
        lines = enumerate(fh, 1)
        while True:
            try:
                lineno, line = next(lines)
            except StopIteration:
                return
            except UnicodeDecodeError:
                raise TraceFormatError(f"{path} is not a text file (compressed? a WEKA trace_NNNN.json.gz?); Mooncake jsonl expected, "
                                       "`kvadvisor evaluate --format weka` reads WEKA traces") from None
            if limit is not None and n >= limit:
                return
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                req = TraceRequest(
                    int(obj["timestamp"]),
                    int(obj["input_length"]),
                    int(obj["output_length"]),
                    tuple(int(h) for h in obj["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceFormatError(f"{path}:{lineno}: not a Mooncake request ({exc}); Mooncake jsonl has "
                                       "one {\"timestamp\", \"input_length\", \"output_length\", \"hash_ids\"} "
                                       "object per line; `kvadvisor evaluate --format weka` reads WEKA traces") from exc
            n += 1
            yield req


@lru_cache(maxsize=65_536)
def _block_tokens(block_id: int, block_tokens: int) -> np.ndarray:
    rng = np.random.default_rng(block_id)
    arr = rng.integers(0, VOCAB_SIZE, size=block_tokens, dtype=np.uint32)
    arr.setflags(write=False)
    return arr


def request_tokens(req: TraceRequest, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> np.ndarray:
    """Token ids of a request's prompt, ``input_length`` of them (uint32, shape ``[n]``).

    Block ``i`` holds tokens derived from ``hash_ids[i]`` alone; the prompt is cut to
    ``input_length`` so the last block may be partial (and is then never registered).
    """
    if not req.hash_ids:
        return np.zeros(0, dtype=np.uint32)
    full = np.concatenate([_block_tokens(h, block_tokens) for h in req.hash_ids])
    n = min(req.input_length, len(full))
    return full[:n]
