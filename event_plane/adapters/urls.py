"""Build vLLM / SGLang adapter subscribers from URL parameters (``vllm+zmq://``,
``sglang+zmq://``; parsed by :func:`event_plane.urls.subscribe`)."""

from __future__ import annotations

from typing import Any

from event_plane.adapters.peer import PeerSubscriber
from event_plane.errors import ConfigError, EventURLError

PEER_PARAMS = frozenset(
    {"replay", "topic", "replay_timeout", "source", "bytes_per_token", "disk_volume", "external_volume",
     "keep_peer_fields"}
)
"""Query parameters an adapter URL may carry."""


def peer_subscriber(
    flavor: str, endpoint: str, replay_endpoint: str | None, query: dict[str, str], url: str, **kw: Any
) -> PeerSubscriber:
    """Create (not start) the adapter subscriber of ``flavor`` (``"vllm"`` / ``"sglang"``).

    Args:
        endpoint / replay_endpoint: the peer's PUB and ROUTER endpoints (``tcp://...``).
        query: URL parameters (see :data:`PEER_PARAMS`); ``source`` defaults to
            ``"<flavor>@<endpoint host:port>"``.
        url: the whole URL, for error messages.
        **kw: subscriber keywords.

    Raises:
        EventURLError: a bad parameter value.
    """
    options: dict[str, Any] = {}
    if "bytes_per_token" in query:
        if not query["bytes_per_token"].isdigit():
            raise EventURLError(f"bytes_per_token must be a non-negative int in {url!r}")
        options["bytes_per_token"] = int(query["bytes_per_token"])
    for name in ("disk_volume", "external_volume"):
        if name in query:
            options[name] = query[name]
    if "keep_peer_fields" in query:
        flag = query["keep_peer_fields"].lower()
        if flag not in ("1", "0", "true", "false", "yes", "no"):
            raise EventURLError(f"keep_peer_fields must be a boolean in {url!r}")
        options["keep_peer_fields"] = flag in ("1", "true", "yes")
    source = query.get("source") or f"{flavor}@{endpoint.removeprefix('tcp://')}"
    topic = query.get("topic", "").encode()
    try:
        if flavor == "vllm":
            from event_plane.adapters.vllm import VllmSubscriber, vllm_config

            return VllmSubscriber(endpoint, replay_endpoint, vllm_config(source, **options), topic, **kw)
        if flavor == "sglang":
            from event_plane.adapters.sglang import SglangSubscriber, sglang_config

            return SglangSubscriber(endpoint, replay_endpoint, sglang_config(source, **options), topic, **kw)
    except ConfigError as exc:
        raise EventURLError(f"{url!r}: {exc}") from exc
    raise EventURLError(f"unknown adapter {flavor!r} in {url!r}")
