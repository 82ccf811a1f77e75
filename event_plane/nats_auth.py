"""NATS credentials and TLS, and URL redaction for messages.

:class:`NatsAuth` holds the connection options a NATS publisher or subscriber may need
(user / password, password file, token, token file, ``.creds`` file, nkey seed file, TLS
with a CA file, a client certificate and key, a server host name) and turns them into
``nats.connect`` keywords (:meth:`NatsAuth.connect_options`). :func:`auth_from_url` reads
them from a ``nats://`` / ``tls://`` / ``jetstream://`` URL; :meth:`NatsAuth.over` layers a
URL's values over defaults (e.g. the advisor's settings).

A password file (:func:`write_password_file`, :func:`read_password_file`) holds one NATS
user's name and password as JSON, mode 0600: ``kvadvisor nats add-worker`` writes one per
worker, and a publisher takes it as ``password_file=PATH`` in its URL or from
``$KVADVISOR_NATS_PASSWORD_FILE`` (:func:`publisher_defaults`), so the password is never on
a command line or in a URL. Every secret file read here (password, token, creds, nkey
seed) must be mode 0600 or stricter (:func:`event_plane.secret_files.check_private_file`).

:func:`redact_url` is the one function that formats a URL for an error message or a log
line: the password (and a NATS token given as the user part) become ``***``, and so does
the value of any query parameter that is not a known, non-secret one.

Imports nothing else of ours but :mod:`event_plane.errors` and :mod:`event_plane.secret_files`.
"""

from __future__ import annotations

import json
import os
import re
import ssl
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from event_plane.errors import ConfigError, EventURLError
from event_plane.secret_files import check_private_file, write_private_file

MASK = "***"

PASSWORD_FILE_ENV = "KVADVISOR_NATS_PASSWORD_FILE"
"""The environment variable naming a NATS password file (:func:`read_password_file`) for
publishers whose URL and caller set no authentication (:func:`publisher_defaults`)."""

NATS_PARAMS = frozenset({
    "password_file", "token_file", "creds", "nkey_seed", "tls", "tls_ca", "tls_cert", "tls_key", "tls_hostname",
})
"""Query parameters of ``nats://``, ``tls://`` and ``jetstream://`` URLs that set
credentials or TLS (file paths, a flag and a host name: none holds a secret itself)."""

_SAFE_PARAMS = NATS_PARAMS | frozenset({
    "namespace", "durable", "max_bytes", "max_age", "discard", "strict_stream", "replicas",
    "replay", "topic", "replay_timeout", "allow_remote", "source", "bytes_per_token", "model", "kv_dtype",
    "num_layers", "num_kv_heads", "head_size", "disk_volume", "external_volume", "keep_peer_fields", "media",
    # ZMQ CURVE (event_plane.curve): file / directory paths and a public key, no secret itself
    "curve_secret", "curve_clients", "curve_server_key", "allowed_publishers",
    # the index partitions a publisher routes to (event_plane.partitioned): numbers
    "partitions", "trunk_depth", "stretch", "manage_stream",
})
"""Query parameters whose values :func:`redact_url` shows; every other value is masked."""

_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def redact_url(url: object) -> str:
    """``url`` fit for a message or a log line: ``scheme://user:***@host:port?...``.

    A comma-separated list (every node of a cluster) is redacted node by node. The
    password becomes ``***``; a user part without a password (NATS reads it as a
    token) becomes ``***`` entirely; values of query parameters other than the known,
    non-secret ones (names, numbers, flags, file paths) become ``***``; a fragment is
    dropped. A value that is not a str, or not parseable, is not shown at all.
    """
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    if "," in url:  # a cluster's nodes, each with its own user part
        return ",".join(redact_url(u.strip()) for u in url.split(","))
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hostport = netloc.rsplit("@", 1)
        if ":" in userinfo:
            userinfo = f"{userinfo.split(':', 1)[0]}:{MASK}"
        else:
            userinfo = MASK
        netloc = f"{userinfo}@{hostport}"
    query = "&".join(
        f"{key}={value if key in _SAFE_PARAMS else MASK}"
        for key, value in parse_qsl(parts.query, keep_blank_values=True)
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


@dataclass(frozen=True)
class NatsAuth:
    """Credentials and TLS of a NATS connection (all optional).

    Authentication (at most one way): ``user`` + ``password``; ``password_file`` (a
    password file holding user and password, :func:`read_password_file`); ``token`` or
    ``token_file`` (a file holding the token); ``creds_file`` (a ``.creds`` file: JWT and
    nkey seed); ``nkey_seed_file`` (an nkey seed file). ``creds_file`` and
    ``nkey_seed_file`` need the ``nkeys`` package. Each file must be mode 0600 or stricter.

    TLS: ``tls`` turns it on (implied by any ``tls_*`` file); ``tls_ca_file`` verifies the
    server (default: the system's CAs); ``tls_cert_file`` + ``tls_key_file`` are the
    client certificate for mutual TLS; ``tls_hostname`` is the name the server's
    certificate must carry (default: the URL's host).

    ``password`` and ``token`` are not shown by ``repr``.

    Raises:
        ConfigError: a password without a user, several ways of authentication, or a
            TLS key without a certificate (or the reverse).
    """

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    password_file: str | None = None
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    creds_file: str | None = None
    nkey_seed_file: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_hostname: str | None = None

    def __post_init__(self) -> None:
        if self.password is not None and self.user is None:
            raise ConfigError("a NATS password needs a user")
        ways = [name for name, on in (
            ("user/password", self.user is not None),
            ("password file", self.password_file is not None),
            ("token", self.token is not None),
            ("token file", self.token_file is not None),
            ("creds file", self.creds_file is not None),
            ("nkey seed file", self.nkey_seed_file is not None),
        ) if on]
        if len(ways) > 1:
            raise ConfigError(f"NATS authentication: give one of {', '.join(ways)}, not several")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("NATS TLS: a client certificate needs its key and the reverse (tls_cert + tls_key)")

    @property
    def has_auth(self) -> bool:
        """Whether any way of authentication is set."""
        return any(v is not None for v in (self.user, self.password_file, self.token, self.token_file,
                                            self.creds_file, self.nkey_seed_file))

    @property
    def uses_tls(self) -> bool:
        """Whether the connection uses TLS (``tls`` or any ``tls_*`` field)."""
        return self.tls or any(v is not None for v in (self.tls_ca_file, self.tls_cert_file, self.tls_key_file,
                                                        self.tls_hostname))

    def over(self, defaults: NatsAuth | None) -> NatsAuth:
        """These values (e.g. a URL's) over ``defaults`` (e.g. settings): the
        authentication is taken as a whole from ``self`` when it sets any, else from
        ``defaults``; each TLS field is ``self``'s when set, else ``defaults``'s."""
        if defaults is None:
            return self
        auth = self if self.has_auth else defaults
        tls: dict[str, Any] = {}
        for f in fields(self):
            if f.name.startswith("tls"):
                mine = getattr(self, f.name)
                tls[f.name] = mine if mine not in (None, False) else getattr(defaults, f.name)
        return replace(auth, **tls)

    def connect_options(self) -> dict[str, Any]:
        """The ``nats.connect`` keywords: ``user`` / ``password`` (given, or read from
        ``password_file``; with ``inbox_prefix``, :func:`inbox_prefix`), ``token`` (read from
        ``token_file``), ``user_credentials``, ``nkeys_seed``, ``tls`` (an
        :class:`ssl.SSLContext`) and ``tls_hostname``.

        Raises:
            ConfigError: a file cannot be read, is empty or malformed, or group or others
                may read it (``chmod 600``), or TLS cannot load the CA / certificate / key
                (the message names the file, never its content).
        """
        opts: dict[str, Any] = {}
        user, password = self.user, self.password
        if self.password_file is not None:
            user, password = read_password_file(self.password_file)
        if user is not None:
            opts["user"] = user
            if password is not None:
                opts["password"] = password
            prefix = inbox_prefix(user)
            if prefix is not None:
                opts["inbox_prefix"] = prefix
        if self.token is not None:
            opts["token"] = self.token
        if self.token_file is not None:
            opts["token"] = _read_secret_file(self.token_file, "token file")
        for path, key, what in ((self.creds_file, "user_credentials", "creds file"),
                                (self.nkey_seed_file, "nkeys_seed", "nkey seed file")):
            if path is not None:
                if not os.path.isfile(path):
                    raise ConfigError(f"NATS {what} {path} does not exist or is not a file")
                check_private_file(path, f"NATS {what}")
                opts[key] = path
        if self.uses_tls:
            opts["tls"] = self.ssl_context()
            if self.tls_hostname is not None:
                opts["tls_hostname"] = self.tls_hostname
        return opts

    def ssl_context(self) -> ssl.SSLContext:
        """A client TLS context verifying the server (``tls_ca_file`` or the system's CAs),
        with the client certificate for mutual TLS when set.

        Raises:
            ConfigError: a file is missing or not a valid CA / certificate / key.
        """
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"NATS TLS: cannot load CA file {self.tls_ca_file}: {type(exc).__name__}") from exc
        if self.tls_cert_file is not None:
            try:
                ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"NATS TLS: cannot load client certificate {self.tls_cert_file} / key "
                                  f"{self.tls_key_file}: {type(exc).__name__}") from exc
        return ctx


_INBOX_TOKEN = re.compile(r"^[A-Za-z0-9_\-@:+=~]+$")


def inbox_prefix(user: str) -> str | None:
    """The reply inbox prefix of NATS user ``user``: ``_INBOX.<user>`` (replies then come
    on ``_INBOX.<user>.<random>``), or ``None`` when ``user`` is not one subject token.

    A server that gives each user ``subscribe: _INBOX.<user>.>`` only (``kvadvisor up``,
    docs/security.md) keeps one user from reading another's replies (JetStream acks,
    query answers); one that allows ``_INBOX.>`` accepts these inboxes too."""
    return f"_INBOX.{user}" if _INBOX_TOKEN.match(user) else None


def _read_secret_file(path: str, what: str) -> str:
    check_private_file(path, f"NATS {what}")
    try:
        with open(path, encoding="utf-8") as fh:
            value = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read NATS {what} {path}: {type(exc).__name__}") from exc
    if not value:
        raise ConfigError(f"NATS {what} {path} is empty")
    return value


def auth_from_url(url: str, query: dict[str, str]) -> NatsAuth:
    """The :class:`NatsAuth` a NATS URL names: ``user:password@`` or ``token@`` in the
    host part (percent-decoded), ``password_file``, ``token_file``, ``creds``, ``nkey_seed``, ``tls``
    (``1``/``0``; the ``tls://`` scheme sets it), ``tls_ca``, ``tls_cert``, ``tls_key``,
    ``tls_hostname`` from ``query``.

    Raises:
        EventURLError: a bad ``tls`` flag or contradicting values (the message shows the
            URL redacted).
    """
    parts = urlsplit(url)
    user = password = token = None
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        if ":" in userinfo:
            raw_user, raw_password = userinfo.split(":", 1)
            user, password = unquote(raw_user), unquote(raw_password)
        else:
            token = unquote(userinfo)
    raw_tls = query.get("tls")
    if raw_tls is not None and raw_tls.lower() not in _BOOLS:
        raise EventURLError(f"tls must be 1 or 0 in {redact_url(url)!r}")
    tls = parts.scheme.lower() == "tls" or (raw_tls is not None and _BOOLS[raw_tls.lower()])
    try:
        return NatsAuth(
            user=user, password=password, password_file=query.get("password_file"), token=token,
            token_file=query.get("token_file"),
            creds_file=query.get("creds"), nkey_seed_file=query.get("nkey_seed"), tls=tls,
            tls_ca_file=query.get("tls_ca"), tls_cert_file=query.get("tls_cert"), tls_key_file=query.get("tls_key"),
            tls_hostname=query.get("tls_hostname"),
        )
    except ConfigError as exc:
        raise EventURLError(f"{exc} in {redact_url(url)!r}") from exc


def server_url(url: str, auth: NatsAuth) -> str:
    """The server address for ``nats.connect``: ``nats://HOST:PORT`` (``tls://`` when
    ``auth`` uses TLS), without the user part: credentials travel as options."""
    hostport = urlsplit(url).netloc.rsplit("@", 1)[-1]
    return f"{'tls' if auth.uses_tls else 'nats'}://{hostport}"


def read_password_file(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(user, password)`` from a NATS password file: JSON ``{"user": NAME, "password":
    SECRET}`` (what :func:`write_password_file` and ``kvadvisor nats add-worker`` write),
    mode 0600 or stricter.

    Raises:
        ConfigError: the file is missing or unreadable, group or others may read it
            (``chmod 600``), or it is not such an object with two non-empty strings (the
            message names the file, never its content).
    """
    what = "NATS password file"
    check_private_file(path, what)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the {what} {path}: {type(exc).__name__}") from exc
    except ValueError:
        data = None  # the message below: never the parser's, which may quote the content
    user = data.get("user") if isinstance(data, dict) else None
    password = data.get("password") if isinstance(data, dict) else None
    if not (isinstance(user, str) and user and isinstance(password, str) and password):
        raise ConfigError(f'{what} {path} must hold JSON {{"user": NAME, "password": SECRET}} '
                          "(kvadvisor nats add-worker writes one)")
    return user, password


def write_password_file(path: str | os.PathLike[str], user: str, password: str) -> None:
    """Write the NATS password file ``path`` of ``user`` (read by :func:`read_password_file`),
    mode 0600, atomically (:func:`event_plane.secret_files.write_private_file`).

    Raises:
        OSError: the directory does not exist or cannot be written.
    """
    write_private_file(path, json.dumps({"user": user, "password": password}) + "\n")


def publisher_defaults(auth: NatsAuth | None) -> NatsAuth | None:
    """The NATS defaults of a publisher: ``auth`` when it sets authentication, else the
    password file that ``$KVADVISOR_NATS_PASSWORD_FILE`` names (with ``auth``'s TLS
    fields), else ``auth``. A URL's own credentials still win over the result
    (:meth:`NatsAuth.over`). The file is read when the publisher connects."""
    path = os.environ.get(PASSWORD_FILE_ENV)
    if not path or (auth is not None and auth.has_auth):
        return auth
    return NatsAuth(password_file=path).over(auth)
