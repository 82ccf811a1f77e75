"""ZMQ CURVE keys for the event sockets: key files, the allowed-publisher list, socket options.

A ZMQ publisher with CURVE on (``zmq://...?curve_secret=FILE``) is the CURVE *server* of
its PUB and replay ROUTER sockets; a subscriber is a client that must know the server's
public key (``curve_server_key=``) and only connects to publishers whose key is in its
allowed list (``allowed_publishers=DIR`` or the advisor's ``zmq_allowed_publishers``).
The CURVE handshake proves that the peer holds the secret key of the public key named,
so a batch can only come from a publisher on the list.

Key files are the standard ZeroMQ certificate files (``zmq.auth.create_certificates``:
``NAME.key`` holds the public key, ``NAME.key_secret`` both). A secret key file must not
be readable by group or others (mode ``0600``): one that is, is refused. Keys are never
logged; errors name the file only. See ``docs/operations.md`` ("Authentication and origins").
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from event_plane.errors import ConfigError
from event_plane.secret_files import check_private_file

Z85_KEY_LEN = 40
"""Length of a CURVE key in Z85 text (32 bytes)."""


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE keypair (Z85 bytes, 40 characters each). ``repr`` hides the secret key."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:
        return f"CurveKeys(public={self.public.decode()!r}, secret=<hidden>)"


def _is_z85_key(text: str) -> bool:
    if len(text) != Z85_KEY_LEN:
        return False
    try:
        return len(zmq.utils.z85.decode(text.encode())) == 32
    except (ValueError, KeyError, TypeError):
        return False


def check_secret_mode(path: str | os.PathLike[str]) -> None:
    """Refuse a secret key file that group or others may read or write
    (:func:`event_plane.secret_files.check_private_file`).

    Raises:
        ConfigError: the file is missing, not a regular file, or its mode has any of the
            ``0o077`` bits (fix: ``chmod 600 FILE``).
    """
    check_private_file(path, "CURVE secret key file")


def load_secret(path: str | os.PathLike[str]) -> CurveKeys:
    """Our keypair from a ZeroMQ secret certificate file (``NAME.key_secret``).

    Raises:
        ConfigError: the file is readable by group / others, unreadable, or holds no
            secret key.
    """
    check_secret_mode(path)
    try:
        public, secret = zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the CURVE secret key file {path}: {type(exc).__name__}") from exc
    if not secret:
        raise ConfigError(f"{path} holds no secret key (give the NAME.key_secret file, not NAME.key)")
    return CurveKeys(public, secret)


def load_public(value: str) -> bytes:
    """A public key (Z85 bytes) given as 40 Z85 characters (percent-encode them in a URL:
    Z85 uses ``&``, ``#``, ``?``...), as 64 hex digits (URL-safe as they are), or as the
    path of a certificate file (public ``NAME.key`` or secret ``NAME.key_secret``: only its
    public key is read).

    Raises:
        ConfigError: none of these forms.
    """
    if _is_z85_key(value):
        return value.encode()
    if len(value) == 64 and all(c in "0123456789abcdefABCDEF" for c in value):
        return bytes(zmq.utils.z85.encode(bytes.fromhex(value)))
    if not os.path.isfile(value):
        raise ConfigError(f"CURVE public key {value[:64]!r} is neither 40 Z85 characters, 64 hex digits nor a "
                          "certificate file")
    try:
        public, _secret = zmq.auth.load_certificate(value)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the CURVE public key file {value}: {type(exc).__name__}") from exc
    return bytes(public)


def load_allowed(location: str | os.PathLike[str]) -> frozenset[bytes]:
    """The public keys of every ``*.key`` certificate file in directory ``location``
    (the allowed-publisher list), or of the one certificate file ``location`` names.

    Raises:
        ConfigError: ``location`` does not exist, or a ``*.key`` file in it does not load.
    """
    path = Path(location)
    if path.is_file():
        return frozenset({load_public(str(path))})
    if not path.is_dir():
        raise ConfigError(f"allowed publishers {location}: no such directory or certificate file")
    keys = set()
    for cert in sorted(path.glob("*.key")):
        keys.add(load_public(str(cert)))
    return frozenset(keys)


def keygen(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write a new keypair as ``DIR/NAME.key`` (public, mode 0644) and
    ``DIR/NAME.key_secret`` (mode 0600), the ZeroMQ certificate format.

    The files are written in a private (0700) temporary directory first and moved into
    place, so the secret key is never readable by others, even for a moment.

    Returns:
        ``(public file, secret file)``.

    Raises:
        ConfigError: ``name`` is not a plain file name, or a file of that name exists.
        OSError: ``directory`` cannot be created or written.
    """
    if not name or os.sep in name or name in (".", "..") or (os.altsep and os.altsep in name):
        raise ConfigError(f"key name must be a plain file name, got {name!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = out / f"{name}.key", out / f"{name}.key_secret"
    for p in (public_path, secret_path):
        if p.exists():
            raise ConfigError(f"{p} already exists (remove it or choose another name)")
    with tempfile.TemporaryDirectory(dir=out, prefix=".keygen-") as tmp:  # mode 0700
        pub_tmp, sec_tmp = zmq.auth.create_certificates(tmp, name)
        os.chmod(sec_tmp, 0o600)
        os.chmod(pub_tmp, 0o644)
        os.replace(sec_tmp, secret_path)
        os.replace(pub_tmp, public_path)
    return public_path, secret_path


def configure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (PUB / ROUTER, before bind) a CURVE server with ``keys``."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def configure_client(sock: zmq.Socket, keys: CurveKeys, server_key: bytes) -> None:
    """Make ``sock`` (SUB / DEALER, before connect) a CURVE client of ``server_key``."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_key


def ephemeral_keys() -> CurveKeys:
    """A fresh keypair for a subscriber that has no key file (publishers that check their
    clients' keys, ``curve_clients=``, refuse it)."""
    public, secret = zmq.curve_keypair()
    return CurveKeys(public, secret)


@dataclass(frozen=True)
class CurveClient:
    """What a ZMQ subscriber needs to connect with CURVE: its keys and the publisher's."""

    keys: CurveKeys
    server_key: bytes


__all__ = [
    "CurveClient",
    "CurveKeys",
    "Z85_KEY_LEN",
    "check_secret_mode",
    "configure_client",
    "configure_server",
    "ephemeral_keys",
    "keygen",
    "load_allowed",
    "load_public",
    "load_secret",
]
