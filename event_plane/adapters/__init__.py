"""Adapters that ingest other engines' KV events (vLLM, SGLang) as KVEvent v1 batches.

Submodules are imported lazily, so ``import event_plane`` stays light. Usually reached
through URLs: ``event_plane.subscribe("vllm+zmq://HOST:5557?replay=5558&source=pod-a")``
or ``sglang+zmq://...`` (parameters: ``replay``, ``topic``, ``source``,
``bytes_per_token`` or the KV geometry ``model``, ``kv_dtype``, ``num_layers``,
``num_kv_heads``, ``head_size`` (:mod:`event_plane.adapters.geometry`), ``disk_volume``,
``external_volume``, ``keep_peer_fields``, ``media``).
Mapping rules: :mod:`event_plane.adapters.peer` and ``docs/events.md`` §10.
"""

from __future__ import annotations

from event_plane.lazy_face import lazy_getattr

_EXPORTS = {
    "PeerConfig": "event_plane.adapters.peer",
    "PeerConverter": "event_plane.adapters.peer",
    "PeerFormatError": "event_plane.adapters.peer",
    "PeerStats": "event_plane.adapters.peer",
    "PeerSubscriber": "event_plane.adapters.peer",
    "hash_to_u64": "event_plane.adapters.peer",
    "VllmSubscriber": "event_plane.adapters.vllm",
    "vllm_config": "event_plane.adapters.vllm",
    "vllm_converter": "event_plane.adapters.vllm",
    "SglangSubscriber": "event_plane.adapters.sglang",
    "sglang_config": "event_plane.adapters.sglang",
    "sglang_converter": "event_plane.adapters.sglang",
    "PeerEmitter": "event_plane.adapters.emit",
    "peer_subscriber": "event_plane.adapters.urls",
    "url_bytes_per_token": "event_plane.adapters.urls",
    "KVGeometry": "event_plane.adapters.geometry",
    "kv_bytes_per_token": "event_plane.adapters.geometry",
    "model_geometry": "event_plane.adapters.geometry",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__
