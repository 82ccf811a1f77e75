"""Build publishers and subscribers from URLs.

=========================================  =============================================
URL                                        meaning
=========================================  =============================================
``null://``                                publisher only, events off: sends nothing;
                                           block pools build no events (``wants_events``)
``zmq://HOST:PORT?replay=PORT&topic=T``    publisher binds ``tcp://HOST:PORT`` (PUB) and
                                           ``tcp://HOST:REPLAY`` (ROUTER); subscriber
                                           connects to both (subscriber only:
                                           ``replay_timeout=S``, inactivity timeout of a
                                           replay in seconds, default 2; also on the
                                           adapter URLs below; publisher only:
                                           ``allow_remote=1`` to bind a HOST
                                           other machines reach, see below)
                                           CURVE (:mod:`event_plane.curve`): publisher
                                           ``curve_secret=FILE`` [``curve_clients=DIR``];
                                           subscriber ``curve_server_key=KEY|FILE``
                                           [``curve_secret=FILE``]
                                           [``allowed_publishers=DIR``]
``nats://[user:pass@]HOST:PORT?namespace=NS``  core NATS (``tls://``: over TLS); NATS
                                           URLs also take ``password_file``,
                                           ``token_file``, ``creds``,
                                           ``nkey_seed``, ``tls=1``, ``tls_ca``,
                                           ``tls_cert``, ``tls_key``, ``tls_hostname``
                                           (:mod:`event_plane.nats_auth`)
``jetstream://[user:pass@]HOST:PORT?namespace=NS&durable=D``  NATS JetStream stream
                                           ``KVADVISOR_EVENTS`` (``durable``: subscriber);
                                           publisher and subscriber: ``max_bytes=N``
                                           (bytes) or ``unlimited``, ``max_age=S``
                                           (seconds) or ``unlimited``, ``discard=old|new``,
                                           ``strict_stream=1|0`` (:class:`StreamLimits`;
                                           a publisher applies them with
                                           ``manage_stream=1`` only: by default it calls no
                                           JetStream API, docs/security.md);
                                           publisher only: ``partitions=P`` (with
                                           ``trunk_depth=K``, default 1, ``stretch=S``,
                                           default 64) routes each event to its index
                                           partition's namespace ``NS-p<k>`` (scaled mode,
                                           :class:`~event_plane.partitioned.PartitionedPublisher`)
``vllm+zmq://HOST:PORT?replay=PORT&source=NAME``  subscriber only: an unmodified vLLM's
                                           KV events, converted to KVEvent v1
``sglang+zmq://HOST:PORT?replay=PORT&source=NAME``  same for SGLang (more parameters:
                                           :mod:`event_plane.adapters`)
=========================================  =============================================

A ``zmq://`` publisher binds loopback hosts only (``127.0.0.0/8``, ``localhost``, ``::1``)
unless CURVE is on (``curve_secret=FILE``: authenticated and encrypted) or the URL says
``allow_remote=1``: without CURVE the ZMQ sockets have no authentication, so any peer
that reaches them reads every event and can ask for replays. A subscriber given allowed
publishers (URL ``allowed_publishers=DIR`` or ``subscribe(zmq_allowed_publishers=)``)
refuses a ``zmq://`` URL without CURVE or whose ``curve_server_key`` is not on the list.

NATS credentials go to ``nats.connect`` as options (the server address passed on carries
none); prefer the file parameters to a password or token in the URL. A publisher whose URL
and caller set no NATS authentication takes the password file named by
``$KVADVISOR_NATS_PASSWORD_FILE`` (:func:`~event_plane.nats_auth.publisher_defaults`). Every
URL in an error message is shown through :func:`~event_plane.nats_auth.redact_url`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

from dataclasses import replace

from event_plane.config import PublisherConfig, StreamLimits
from event_plane.curve import CurveClient, ephemeral_keys, load_allowed, load_public, load_secret
from event_plane.errors import ConfigError, EventURLError
from event_plane.nats_auth import NATS_PARAMS, NatsAuth, auth_from_url, publisher_defaults, redact_url, server_url
from event_plane.nats_transport import JetStreamPublisher, JetStreamSubscriber, NatsPublisher, NatsSubscriber
from event_plane.publisher import EventPublisher, FlushCallback, NullPublisher
from event_plane.subscriber import MultiSubscriber, Subscriber
from event_plane.zmq_transport import ZmqPublisher, ZmqSubscriber, is_loopback_endpoint

_ALLOWED = {
    "null": set(),
    "zmq": {"replay", "topic", "replay_timeout", "allow_remote", "curve_secret", "curve_clients", "curve_server_key",
            "allowed_publishers"},
    "nats": {"namespace"} | NATS_PARAMS,
    "tls": {"namespace"} | NATS_PARAMS,
    "jetstream": {"namespace", "durable", "max_bytes", "max_age", "discard", "strict_stream", "replicas",
                  "partitions", "trunk_depth", "stretch", "manage_stream"} | NATS_PARAMS,
    # = event_plane.adapters.urls.PEER_PARAMS (not imported: adapters load lazily; a test pins both)
    "vllm+zmq": {"replay", "topic", "replay_timeout", "source", "bytes_per_token", "model", "kv_dtype", "num_layers",
                 "num_kv_heads", "head_size", "disk_volume", "external_volume", "keep_peer_fields", "media"},
}
_ALLOWED["sglang+zmq"] = _ALLOWED["vllm+zmq"]
_PEER_SCHEMES = {"vllm+zmq": "vllm", "sglang+zmq": "sglang"}


def _parse(url: str) -> tuple[str, str, int | None, dict[str, str], str]:
    """-> (scheme, host, port, query, netloc). Raises EventURLError."""
    if not isinstance(url, str):
        raise EventURLError(f"event URL must be a str, got {type(url).__name__}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _ALLOWED:
        raise EventURLError(f"unsupported event URL scheme {parts.scheme!r} in {redact_url(url)!r} (use {sorted(_ALLOWED)})")
    query: dict[str, str] = {}
    for key, values in parse_qs(parts.query, keep_blank_values=True, strict_parsing=False).items():
        if key not in _ALLOWED[scheme]:
            raise EventURLError(f"unknown parameter {key!r} in {redact_url(url)!r} (allowed: {sorted(_ALLOWED[scheme])})")
        if len(values) != 1:
            raise EventURLError(f"parameter {key!r} given {len(values)} times in {redact_url(url)!r}")
        query[key] = values[0]
    if scheme == "null":
        return scheme, "", None, query, ""
    try:
        port = parts.port
    except ValueError as exc:
        raise EventURLError(f"bad port in {redact_url(url)!r}: {exc}") from exc
    host = parts.hostname or ""
    if not host or port is None:
        raise EventURLError(f"{redact_url(url)!r} needs HOST:PORT")
    return scheme, host, port, query, parts.netloc


def _zmq_endpoints(host: str, port: int, query: dict[str, str], url: str) -> tuple[str, str | None]:
    replay = query.get("replay")
    if replay is not None and not replay.isdigit():
        raise EventURLError(f"replay must be a port number in {redact_url(url)!r}")
    host_part = f"[{host}]" if ":" in host else host
    pub = f"tcp://{host_part}:{port}"
    return pub, (f"tcp://{host_part}:{replay}" if replay is not None else None)


_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_ZMQ_PUBLISHER_ONLY = ("allow_remote", "curve_clients")
_ZMQ_SUBSCRIBER_ONLY = ("replay_timeout", "curve_server_key", "allowed_publishers")


def _zmq_publisher_curve(query: dict[str, str], url: str) -> dict[str, Any]:
    """``ZmqPublisher`` keywords ``curve`` / ``curve_clients`` from ``curve_secret=FILE``
    and ``curve_clients=DIR`` (``{}`` without CURVE)."""
    for key in _ZMQ_SUBSCRIBER_ONLY:
        if key in query:
            raise EventURLError(f"{key} is a subscriber parameter (in {redact_url(url)!r})")
    if "curve_secret" not in query:
        if "curve_clients" in query:
            raise EventURLError(f"curve_clients needs curve_secret=FILE (in {redact_url(url)!r})")
        return {}
    try:
        keys = load_secret(query["curve_secret"])
    except ConfigError as exc:
        raise EventURLError(f"{exc} (for {redact_url(url)!r})") from exc
    clients = query.get("curve_clients")
    if clients is not None and not os.path.isdir(clients):
        raise EventURLError(f"curve_clients must be a directory of public key files, got {clients!r} "
                            f"(in {redact_url(url)!r})")
    return {"curve": keys, "curve_clients": clients}


def _zmq_subscriber_curve(query: dict[str, str], url: str, allowed: frozenset[bytes] | None,
                          secret: str | None) -> CurveClient | None:
    """The CURVE side of a ``zmq://`` subscriber URL: ``curve_server_key`` (the
    publisher's public key, Z85 or a certificate file) with our key from ``curve_secret``
    (else ``secret``, else a fresh one), checked against the allowed publishers (the URL's
    ``allowed_publishers`` directory and ``allowed``: with either set, the publisher must
    use CURVE with a key on the list).

    Raises:
        EventURLError: a key that does not load, a world-readable secret key file, or a
            publisher not on the allowed list.
    """
    for key in _ZMQ_PUBLISHER_ONLY:
        if key in query:
            raise EventURLError(f"{key} is a publisher parameter (in {redact_url(url)!r})")
    try:
        if "allowed_publishers" in query:
            allowed = load_allowed(query["allowed_publishers"]) | (allowed or frozenset())
        server = query.get("curve_server_key")
        if server is None:
            if "curve_secret" in query:
                raise EventURLError(f"curve_secret needs curve_server_key (the publisher's public key) in "
                                    f"{redact_url(url)!r}")
            if allowed is not None:
                raise EventURLError(f"{redact_url(url)!r} has no curve_server_key, and only publishers on the allowed "
                                    "list (CURVE keys) are accepted: add curve_server_key=KEY_OR_FILE")
            return None
        server_key = load_public(server)
        if allowed is not None and server_key not in allowed:
            raise EventURLError(f"the publisher key of {redact_url(url)!r} ({server_key.decode()}) is not on the "
                                f"allowed publishers list ({len(allowed)} keys)")
        path = query.get("curve_secret", secret)
        keys = load_secret(path) if path is not None else ephemeral_keys()
    except ConfigError as exc:
        raise EventURLError(f"{exc} (for {redact_url(url)!r})") from exc
    return CurveClient(keys, server_key)


def _allow_remote(query: dict[str, str], url: str) -> bool:
    """The ``allow_remote`` flag: ``1``/``true``/``yes`` or ``0``/``false``/``no`` (default off)."""
    raw = query.get("allow_remote", "0").lower()
    if raw not in _BOOLS:
        raise EventURLError(f"allow_remote must be 1 or 0 in {redact_url(url)!r}, got {raw!r}")
    return _BOOLS[raw]


def _positive_seconds(raw: str) -> float | None:
    """``raw`` as a finite number of seconds > 0, else ``None``."""
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None


def _replay_timeout(query: dict[str, str], url: str) -> dict[str, float]:
    """``{"replay_timeout_s": S}`` from a ``replay_timeout=S`` parameter (seconds > 0), else ``{}``."""
    raw = query.get("replay_timeout")
    if raw is None:
        return {}
    value = _positive_seconds(raw)
    if value is None:
        raise EventURLError(f"replay_timeout must be a number of seconds > 0 in {redact_url(url)!r}, got {raw!r}")
    return {"replay_timeout_s": value}


def stream_limits_from_query(query: dict[str, str], url: str, base: StreamLimits | None = None) -> StreamLimits:
    """``base`` (default :class:`StreamLimits`) with the stream parameters of a
    ``jetstream://`` URL's query applied: ``max_bytes`` (an int of bytes > 0, or
    ``unlimited``), ``max_age`` (seconds > 0, or ``unlimited``), ``discard`` (``old`` /
    ``new``), ``replicas`` (1, 3 or 5), ``strict_stream`` (``1``/``true``/``yes`` or
    ``0``/``false``/``no``).

    Raises:
        EventURLError: a value out of range or of the wrong form (named with the URL).
    """
    limits = base if base is not None else StreamLimits()
    if not isinstance(limits, StreamLimits):
        raise EventURLError(f"stream must be a StreamLimits, got {type(limits).__name__}")
    changes: dict[str, object] = {}
    raw = query.get("max_bytes")
    if raw is not None:
        if raw.lower() == "unlimited":
            changes["max_bytes"] = None
        elif raw.isdigit() and int(raw) > 0:
            changes["max_bytes"] = int(raw)
        else:
            raise EventURLError(f"max_bytes must be a number of bytes > 0 or 'unlimited' in {redact_url(url)!r}, got {raw!r}")
    raw = query.get("max_age")
    if raw is not None:
        if raw.lower() == "unlimited":
            changes["max_age_s"] = None
        else:
            value = _positive_seconds(raw)
            if value is None:
                raise EventURLError(f"max_age must be a number of seconds > 0 or 'unlimited' in {redact_url(url)!r}, got {raw!r}")
            changes["max_age_s"] = value
    raw = query.get("discard")
    if raw is not None:
        if raw not in ("old", "new"):
            raise EventURLError(f"discard must be 'old' or 'new' in {redact_url(url)!r}, got {raw!r}")
        changes["discard"] = raw
    raw = query.get("replicas")
    if raw is not None:
        if raw not in ("1", "3", "5"):
            raise EventURLError(f"replicas must be 1, 3 or 5 in {redact_url(url)!r}, got {raw!r}")
        changes["replicas"] = int(raw)
    raw = query.get("strict_stream")
    if raw is not None:
        if raw.lower() not in _BOOLS:
            raise EventURLError(f"strict_stream must be 1 or 0 (true/false) in {redact_url(url)!r}, got {raw!r}")
        changes["strict"] = _BOOLS[raw.lower()]
    try:
        return replace(limits, **changes)  # type: ignore[arg-type]
    except ConfigError as exc:  # unreachable after the checks above; kept for a clear error
        raise EventURLError(f"{exc} in {redact_url(url)!r}") from exc


def make_publisher(
    url: str,
    source: str,
    *,
    config: PublisherConfig | None = None,
    epoch: int | None = None,
    on_flush: FlushCallback | None = None,
    stream: StreamLimits | None = None,
    nats_auth: NatsAuth | None = None,
    **options: Any,
) -> EventPublisher:
    """Create the publisher that ``url`` names (see the module table).

    Args:
        url: ``null://``, ``zmq://...``, ``nats://...`` or ``jetstream://...``.
        source: worker / instance id.
        config, epoch, on_flush: see :class:`EventPublisher`.
        stream: ``jetstream://`` only (other schemes ignore it): the stream limits, which
            the URL's ``max_bytes`` / ``max_age`` / ``discard`` / ``strict_stream``
            override field by field (``None``: :class:`StreamLimits` defaults).
        nats_auth: NATS URLs only: credentials / TLS used where the URL sets none
            (the URL's own authentication wins as a whole, its TLS values field by field);
            without authentication here, the password file of
            ``$KVADVISOR_NATS_PASSWORD_FILE`` when set
            (:func:`~event_plane.nats_auth.publisher_defaults`).
        **options: transport keywords (``nats.connect`` keywords win over the URL's).

    Raises:
        EventURLError: malformed or unsupported URL; a NATS credential file that cannot be
            read, is malformed or that group or others may read (``chmod 600``).
        TransportError: the endpoint cannot be bound / the server reached.
    """
    scheme, host, port, query, netloc = _parse(url)
    if scheme in _PEER_SCHEMES:
        raise EventURLError(f"{scheme}:// is subscriber only (it reads another engine's events)")
    common: dict[str, Any] = {"epoch": epoch, "config": config, "on_flush": on_flush}
    if scheme == "null":
        return NullPublisher(source, **common)
    if scheme == "zmq":
        curve = _zmq_publisher_curve(query, url)
        pub, replay = _zmq_endpoints(host, port or 0, query, url)
        allow_remote = _allow_remote(query, url) or bool(options.pop("allow_remote", False))
        if not allow_remote and not curve and not (
            is_loopback_endpoint(pub) and (replay is None or is_loopback_endpoint(replay))
        ):
            raise EventURLError(
                f"{redact_url(url)!r} binds host {host!r}, which other machines can reach, and ZMQ event sockets have no "
                "authentication (any peer could read the events and ask for replays): use a loopback host "
                "(127.0.0.1, localhost, [::1]), turn CURVE on (curve_secret=FILE), or add allow_remote=1 to the URL "
                "on a trusted network"
            )
        return ZmqPublisher(source, pub, replay, query.get("topic", ""), **common, allow_remote=allow_remote,
                            **curve, **options)
    server, connect = _nats_target(url, query, publisher_defaults(nats_auth))
    connect.update(options)  # a caller's explicit nats.connect keywords win
    if scheme == "jetstream":
        limits = stream_limits_from_query(query, url, stream)
        raw = query.get("manage_stream")
        if raw is not None:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise EventURLError(f"manage_stream must be 1 or 0 in {redact_url(url)!r}, got {raw!r}")
            connect.setdefault("manage_stream", raw.lower() in ("1", "true", "yes"))
        namespace = query.get("namespace", "default")
        scheme_p = _partition_scheme(query, url)
        if scheme_p is not None:
            from event_plane.partitioned import PartitionedPublisher, partition_namespace
            from event_plane.publisher import new_epoch

            common["epoch"] = new_epoch() if epoch is None else epoch  # one epoch for every partition
            return PartitionedPublisher(scheme_p, lambda k: JetStreamPublisher(  # type: ignore[return-value]
                source, server, partition_namespace(namespace, k), **common, stream=limits, **connect))
        return JetStreamPublisher(source, server, namespace, **common, stream=limits, **connect)
    return NatsPublisher(source, server, query.get("namespace", "default"), **common, **connect)


def _partition_scheme(query: dict[str, str], url: str) -> Any:
    """The :class:`~event_plane.partition.PartitionScheme` a publisher URL's ``partitions``,
    ``trunk_depth`` and ``stretch`` name, or ``None`` without ``partitions``.

    Raises:
        EventURLError: a value that is not a positive integer (``trunk_depth`` may be 0).
    """
    if "partitions" not in query:
        if "trunk_depth" in query or "stretch" in query:
            raise EventURLError(f"trunk_depth / stretch need partitions= in {redact_url(url)!r}")
        return None
    from event_plane.partition import PartitionError, PartitionScheme

    try:
        return PartitionScheme(int(query["partitions"]), int(query.get("trunk_depth", "1")),
                               int(query.get("stretch", "64")))
    except (ValueError, PartitionError) as exc:
        raise EventURLError(f"bad partitions / trunk_depth / stretch in {redact_url(url)!r}: {exc}") from None


def _nats_target(url: str, query: dict[str, str], defaults: NatsAuth | None) -> tuple[str, dict[str, Any]]:
    """(server URL without credentials, ``nats.connect`` keywords) of a NATS URL whose
    credentials / TLS are layered over ``defaults`` (:meth:`NatsAuth.over`)."""
    auth = auth_from_url(url, query).over(defaults)
    try:
        options = auth.connect_options()
    except ConfigError as exc:
        raise EventURLError(f"{exc} (for {redact_url(url)!r})") from exc
    return server_url(url, auth), options


def nats_connection(url: str, defaults: NatsAuth | None = None) -> tuple[str, dict[str, Any]]:
    """The server address and ``nats.connect`` keywords of a ``nats://``, ``tls://`` or
    ``jetstream://`` URL (credentials and TLS from the URL over ``defaults``; the
    returned address carries no credentials).

    Raises:
        EventURLError: not a NATS URL, a malformed one, or unreadable credential / TLS files.
    """
    scheme, _host, _port, query, _netloc = _parse(url)
    if scheme not in ("nats", "tls", "jetstream"):
        raise EventURLError(f"{redact_url(url)!r} is not a nats://, tls:// or jetstream:// URL")
    return _nats_target(url, query, defaults)


def _subscriber(url: str, kw: dict[str, Any]) -> Subscriber:
    scheme, host, port, query, netloc = _parse(url)
    stream = kw.pop("stream", None)  # jetstream:// only
    nats_auth = kw.pop("nats_auth", None)  # NATS URLs only
    allowed = kw.pop("zmq_allowed_publishers", None)  # zmq:// only
    zmq_secret = kw.pop("zmq_curve_secret", None)  # zmq:// only
    if scheme == "null":
        raise EventURLError("null:// has nothing to subscribe to")
    if scheme == "zmq" or scheme in _PEER_SCHEMES:
        if host in ("*", "0.0.0.0", "::"):
            raise EventURLError(f"a subscriber must connect to a concrete host, got {host!r} in {redact_url(url)!r}")
        if "allow_remote" in query:
            raise EventURLError(f"allow_remote is a publisher parameter (in {redact_url(url)!r})")
        pub, replay = _zmq_endpoints(host, port or 0, query, url)
        kw = {**kw, **_replay_timeout(query, url)}
        if scheme in _PEER_SCHEMES:
            if allowed is not None:
                raise EventURLError(f"{redact_url(url)!r}: {scheme}:// publishers have no CURVE key, and only "
                                    "publishers on the allowed list (zmq_allowed_publishers) are accepted")
            from event_plane.adapters.urls import peer_subscriber  # lazy: adapters are optional

            return peer_subscriber(_PEER_SCHEMES[scheme], pub, replay, query, url, **kw)
        curve = _zmq_subscriber_curve(query, url, _allowed_keys(allowed), zmq_secret)
        return ZmqSubscriber([(pub, replay)], query.get("topic", "").encode(), curve=curve, **kw)
    namespace = query.get("namespace", "default")
    if {"partitions", "trunk_depth", "stretch", "manage_stream"} & set(query):
        raise EventURLError(f"partitions / trunk_depth / stretch / manage_stream are publisher parameters (in {redact_url(url)!r}): "
                            "a partition's log is the namespace NS-p<k>, or read them all with "
                            "python -m advisor.cluster")
    server, connect = _nats_target(url, query, nats_auth)
    kw = {**connect, **kw}  # a caller's explicit nats.connect keywords win
    if scheme == "jetstream":
        if "durable" in query:
            kw = {**kw, "durable": query["durable"]}
        kw["stream"] = stream_limits_from_query(query, url, stream)
        return JetStreamSubscriber(server, namespace, **kw)
    return NatsSubscriber(server, namespace, **kw)


def _allowed_keys(allowed: Any) -> frozenset[bytes] | None:
    """``zmq_allowed_publishers``: ``None``, a directory / certificate file, or keys."""
    if allowed is None or isinstance(allowed, frozenset):
        return allowed
    if isinstance(allowed, str | os.PathLike):
        try:
            return load_allowed(allowed)
        except ConfigError as exc:
            raise EventURLError(str(exc)) from exc
    return frozenset(k if isinstance(k, bytes) else str(k).encode() for k in allowed)


def subscribe(urls: str | Sequence[str], **kw: Any) -> Subscriber:
    """Create (not yet started) subscriber(s) for ``urls``; several URLs are merged.

    Args:
        urls: one URL or a list (``zmq://``, ``nats://``, ``jetstream://``,
            ``vllm+zmq://``, ``sglang+zmq://``).
        **kw: subscriber keywords (``on_gap``, ``queue_capacity``, ``on_resync``,
            transport options); ``stream=StreamLimits(...)`` goes to ``jetstream://``
            URLs only, whose stream parameters override it field by field;
            ``nats_auth=NatsAuth(...)``: credentials / TLS for NATS URLs that set none
            (as in :func:`make_publisher`); ``zmq_allowed_publishers`` (a directory of
            ``*.key`` files, one certificate file, or Z85 keys): every ``zmq://`` URL must
            use CURVE with a publisher key on it (added to the URL's own
            ``allowed_publishers``); ``zmq_curve_secret`` (a secret key file): our CURVE
            key for ``zmq://`` URLs that name none; ``origins=OriginGuard(...)``: bind
            each source to its origin (:mod:`event_plane.origins`).

    Returns:
        A :class:`Subscriber`; call ``start()`` (or use it as a context manager).

    Raises:
        EventURLError: malformed URL, or no URL.
    """
    origins = kw.pop("origins", None)
    if "zmq_allowed_publishers" in kw:
        kw["zmq_allowed_publishers"] = _allowed_keys(kw["zmq_allowed_publishers"])  # read the directory once
    if isinstance(urls, str):
        urls = [urls]
    urls = list(urls)
    if not urls:
        raise EventURLError("subscribe() needs at least one URL")
    if len(urls) == 1:
        sub = _subscriber(urls[0], dict(kw))
    else:
        capacity = kw.get("queue_capacity", 100_000)
        sub = MultiSubscriber(
            [_subscriber(u, dict(kw)) for u in urls], queue_capacity=capacity, on_resync=kw.get("on_resync")
        )
    if origins is not None:
        sub.guard_origins(origins)
    return sub
