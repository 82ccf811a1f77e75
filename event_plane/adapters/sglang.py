"""SGLang KV-event adapter: subscribe to an unmodified SGLang server's ZMQ KV-event
publisher and get KVEvent v1 batches.

SGLang specifics (``docs/events.md`` §10): same ZMQ machinery as
vLLM; the batch's third element is the attention DP rank; ``medium`` is ``GPU``,
``CPU_PINNED``, ``DISK`` or ``EXTERNAL``; newer releases add ``cache_salt`` and
``session_id`` and use tagged maps; replay replies have no topic frame (``[seq,
payload]``). A page hash is published as the *first* 8 bytes of its SHA-256 digest as a
*signed* 64-bit int; :func:`~event_plane.adapters.peer.hash_to_u64` maps it to the u64 with
the same bits, and reduces a raw digest by its first 8 bytes (``"first8"``) to match.
"""

from __future__ import annotations

from typing import Any

from event_plane.adapters.peer import CLEARED, REMOVED, STORED, PeerConfig, PeerConverter, PeerSubscriber

SGLANG_FIELDS: dict[str, tuple[str, ...]] = {
    STORED: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "cache_salt", "session_id"),
    REMOVED: ("block_hashes", "medium"),
    CLEARED: (),
}
"""Array-form field order of SGLang's event classes (after the tag)."""


def sglang_config(source: str, **options: Any) -> PeerConfig:
    """:class:`PeerConfig` for an SGLang worker (digest rule ``"first8"``); ``options`` are
    the other :class:`PeerConfig` fields. Raises :class:`~event_plane.errors.ConfigError`."""
    return PeerConfig(source, **{"digest_rule": "first8", **options})


def sglang_converter(config: PeerConfig) -> PeerConverter:
    """A converter of SGLang batches."""
    return PeerConverter(config, SGLANG_FIELDS)


class SglangSubscriber(PeerSubscriber):
    """Subscriber of one SGLang worker's KV events, yielding KVEvent v1 batches.

    Args:
        endpoint: SGLang's PUB endpoint.
        replay_endpoint: SGLang's replay ROUTER endpoint, or ``None``.
        config: mapping settings (:func:`sglang_config`).
        topic: topic prefix.
        **kw: subscriber keywords (``on_gap``, ``queue_capacity``, ``on_resync``, ...).
    """

    def __init__(
        self, endpoint: str, replay_endpoint: str | None, config: PeerConfig, topic: bytes = b"", **kw: Any
    ) -> None:
        super().__init__(endpoint, replay_endpoint, sglang_converter(config), topic, **kw)
