"""vLLM KV-event adapter: subscribe to an unmodified vLLM's ZMQ KV-event publisher
(``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``) and
get KVEvent v1 batches.

vLLM specifics (``docs/events.md`` §10): batch ``[ts, events,
data_parallel_rank?]``; array-form field order below; hashes are u64 ints (the last 8 bytes
of the SHA-256 digest, big-endian) or, with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, the
raw 32-byte digest, which :func:`~event_plane.adapters.peer.hash_to_u64` reduces the same
way (``"last8"``), so both settings name a block by the same u64. Replay replies are
``[topic, seq, payload]`` since v0.26 and ``[seq, payload]`` before; both are read.

vLLM publishes ``block_size`` in tokens; bytes need the model's KV bytes per token
(:func:`vllm_config`'s ``bytes_per_token``, or the URL's ``model=`` / ``kv_dtype=``
parameters, :mod:`event_plane.adapters.geometry`).
"""

from __future__ import annotations

from typing import Any

from event_plane.adapters.peer import CLEARED, REMOVED, STORED, PeerConfig, PeerConverter, PeerSubscriber

VLLM_FIELDS: dict[str, tuple[str, ...]] = {
    STORED: (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    REMOVED: ("block_hashes", "medium", "group_idx"),
    CLEARED: (),
}
"""Array-form field order of vLLM's event classes (after the tag)."""


def vllm_config(source: str, **options: Any) -> PeerConfig:
    """:class:`PeerConfig` for a vLLM worker (digest rule ``"last8"``); ``options`` are the
    other :class:`PeerConfig` fields. Raises :class:`~event_plane.errors.ConfigError`."""
    return PeerConfig(source, **{"digest_rule": "last8", **options})


def vllm_converter(config: PeerConfig) -> PeerConverter:
    """A converter of vLLM batches."""
    return PeerConverter(config, VLLM_FIELDS)


class VllmSubscriber(PeerSubscriber):
    """Subscriber of one vLLM worker's KV events, yielding KVEvent v1 batches.

    Args:
        endpoint: vLLM's PUB endpoint (default port 5557).
        replay_endpoint: vLLM's replay ROUTER endpoint (e.g. port 5558), or ``None``.
        config: mapping settings (:func:`vllm_config`).
        topic: topic prefix (vLLM's default topic is empty).
        **kw: subscriber keywords (``on_gap``, ``queue_capacity``, ``on_resync``, ...).
    """

    def __init__(
        self, endpoint: str, replay_endpoint: str | None, config: PeerConfig, topic: bytes = b"", **kw: Any
    ) -> None:
        super().__init__(endpoint, replay_endpoint, vllm_converter(config), topic, **kw)
