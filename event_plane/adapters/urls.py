"""Build vLLM / SGLang adapter subscribers from URL parameters (``vllm+zmq://``,
``sglang+zmq://``; parsed by :func:`event_plane.urls.subscribe`)."""

from __future__ import annotations

from typing import Any

from event_plane.adapters.geometry import KVGeometry, kv_bytes_per_token, model_geometry
from event_plane.adapters.peer import PeerSubscriber
from event_plane.errors import ConfigError, EventURLError
from event_plane.nats_auth import redact_url

GEOMETRY_PARAMS = ("num_layers", "num_kv_heads", "head_size")
"""URL parameters giving the KV geometry directly (ints > 0)."""

PEER_PARAMS = frozenset(
    {
        "replay",
        "topic",
        "replay_timeout",
        "source",
        "bytes_per_token",
        "model",
        "kv_dtype",
        *GEOMETRY_PARAMS,
        "disk_volume",
        "external_volume",
        "keep_peer_fields",
        "media",
    }
)
"""Query parameters an adapter URL may carry."""


def url_bytes_per_token(query: dict[str, str], url: str) -> int | None:
    """KV bytes per token from an adapter URL's parameters, or ``None`` when none gives it.

    Sources, in order: ``bytes_per_token=N`` (wins; the others are still checked);
    ``model=DIR`` (a local Hugging Face model directory: its ``config.json``, see
    :func:`~event_plane.adapters.geometry.model_geometry`), each of ``num_layers``,
    ``num_kv_heads``, ``head_size`` overriding the model's value; without ``model`` all
    three plus ``kv_dtype``. ``kv_dtype`` (vLLM's KV-cache dtype: ``float16``,
    ``bfloat16``, ``float32``, ``fp8``, ...; ``auto`` = the model's) overrides the model's
    dtype. Formula: :func:`~event_plane.adapters.geometry.kv_bytes_per_token`.

    Raises:
        EventURLError: a non-int value, an unreadable ``config.json``, an unknown dtype,
            or an incomplete explicit geometry, naming the parameter.
    """
    explicit: int | None = None
    if "bytes_per_token" in query:
        if not query["bytes_per_token"].isdigit():
            raise EventURLError(f"bytes_per_token must be a non-negative int in {redact_url(url)!r}")
        explicit = int(query["bytes_per_token"])
    given: dict[str, int] = {}
    for name in GEOMETRY_PARAMS:
        if name in query:
            if not query[name].isdigit() or int(query[name]) == 0:
                raise EventURLError(f"{name} must be an int > 0 in {redact_url(url)!r}, got {query[name]!r}")
            given[name] = int(query[name])
    kv_dtype = query.get("kv_dtype")
    if "model" not in query and not given and kv_dtype is None:
        return explicit
    try:
        if "model" in query:
            if not query["model"]:
                raise ConfigError("model must name a local model directory")
            geo = model_geometry(query["model"])
        else:
            missing = [n for n in GEOMETRY_PARAMS if n not in given]
            if kv_dtype in (None, "auto"):
                missing.append("kv_dtype")
            if missing:
                raise ConfigError(
                    "without model=, the KV geometry needs num_layers, num_kv_heads, head_size and "
                    f"kv_dtype (auto needs model=); missing: {', '.join(missing)}"
                )
            geo = KVGeometry(given["num_layers"], given["num_kv_heads"], given["head_size"], kv_dtype or "")
        dtype = geo.dtype if kv_dtype in (None, "auto") else kv_dtype
        computed = kv_bytes_per_token(
            given.get("num_layers", geo.num_layers), given.get("num_kv_heads", geo.num_kv_heads),
            given.get("head_size", geo.head_size), dtype,
        )
    except ConfigError as exc:
        raise EventURLError(f"{redact_url(url)!r}: {exc}") from exc
    return computed if explicit is None else explicit


def peer_subscriber(
    flavor: str, endpoint: str, replay_endpoint: str | None, query: dict[str, str], url: str, **kw: Any
) -> PeerSubscriber:
    """Create (not start) the adapter subscriber of ``flavor`` (``"vllm"`` / ``"sglang"``).

    Args:
        endpoint / replay_endpoint: the peer's PUB and ROUTER endpoints (``tcp://...``).
        query: URL parameters (see :data:`PEER_PARAMS`); ``source`` defaults to
            ``"<flavor>@<endpoint host:port>"``; the KV bytes per token come from
            :func:`url_bytes_per_token`.
        url: the whole URL, for error messages.
        **kw: subscriber keywords.

    Raises:
        EventURLError: a bad parameter value.
    """
    options: dict[str, Any] = {}
    bytes_per_token = url_bytes_per_token(query, url)
    if bytes_per_token is not None:
        options["bytes_per_token"] = bytes_per_token
    for name in ("disk_volume", "external_volume"):
        if name in query:
            options[name] = query[name]
    if "media" in query:
        media = tuple(m.strip().upper() for m in query["media"].split(",") if m.strip())
        if not media:
            raise EventURLError(f"media must name at least one medium (e.g. media=GPU) in {redact_url(url)!r}")
        options["only_media"] = media
    if "keep_peer_fields" in query:
        flag = query["keep_peer_fields"].lower()
        if flag not in ("1", "0", "true", "false", "yes", "no"):
            raise EventURLError(f"keep_peer_fields must be a boolean in {redact_url(url)!r}")
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
        raise EventURLError(f"{redact_url(url)!r}: {exc}") from exc
    raise EventURLError(f"unknown adapter {flavor!r} in {redact_url(url)!r}")
