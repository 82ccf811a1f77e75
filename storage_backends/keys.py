"""Injective names for block keys, volumes and segments.

Nothing here is lossy: every name is either kept byte for byte or percent-encoded with
``%`` itself encoded, so two different inputs never give the same file name or object key
(docs/design.md §6, case C13).  S3 limits object keys to 1024 bytes of UTF-8; the limits below
keep ``<prefix>/<volume>/seg-<id>`` under it and are checked when a volume is registered.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from .types import BlockKey, InvalidRequestError, VolumeConfigError

U64_MAX = (1 << 64) - 1
MAX_VOLUME_ID_BYTES = 128
MAX_PREFIX_BYTES = 600
MAX_OBJECT_KEY_BYTES = 1024
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def encode_component(name: str) -> str:
    """Percent-encode ``name`` (UTF-8) keeping only ``[A-Za-z0-9_-]``.

    Injective: ``%`` and ``.`` are encoded too, so ``"."``/``".."`` can never appear and
    ``"a/b"`` (``a%2Fb``) differs from a literal ``"a%2Fb"`` (``a%252Fb``).
    """
    return "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in name.encode("utf-8"))


#: tier names of the worker-private tiers; a volume id is a ``storage_location`` in events,
#: so it must never read as one of them (compared case-insensitively)
RESERVED_VOLUME_IDS = frozenset({"g1", "g2"})


def validate_volume_id(volume_id: str) -> None:
    """Check that ``volume_id`` can be an event ``storage_location``: one plain token.

    Rules: a non-empty ``str`` of at most 128 UTF-8 bytes; no whitespace, ``/`` or
    control characters (Unicode category ``Cc``); not ``.`` or ``..``; not a private tier
    name (``g1``, ``g2``, any case).

    Raises:
        VolumeConfigError: naming the id and the rule it breaks.
    """
    if not isinstance(volume_id, str) or not volume_id:
        raise VolumeConfigError(f"volume id must be a non-empty string, got {volume_id!r}")
    if len(volume_id.encode("utf-8")) > MAX_VOLUME_ID_BYTES:
        raise VolumeConfigError(f"volume id {volume_id[:40]!r}... is longer than {MAX_VOLUME_ID_BYTES} bytes")
    if _CONTROL.search(volume_id) or any(unicodedata.category(c) == "Cc" for c in volume_id):
        raise VolumeConfigError(f"volume id {volume_id!r} contains control characters")
    if any(c.isspace() for c in volume_id):
        raise VolumeConfigError(f"volume id {volume_id!r} contains whitespace (it must be a single token)")
    if "/" in volume_id:
        raise VolumeConfigError(f"volume id {volume_id!r} contains '/' (it must be a single token)")
    if volume_id in (".", ".."):
        raise VolumeConfigError(f"volume id {volume_id!r} is not allowed ('.' and '..' are path names)")
    if volume_id.casefold() in RESERVED_VOLUME_IDS:
        raise VolumeConfigError(
            f"volume id {volume_id!r} is reserved: {sorted(RESERVED_VOLUME_IDS)} name the private tiers "
            "in events (case-insensitive)"
        )


def normalize_prefix(prefix: str) -> str:
    """Validate an S3 key prefix and drop its leading/trailing ``/``.

    Raises:
        VolumeConfigError: control characters, empty path segments (``a//b``), or more
            than 600 UTF-8 bytes.
    """
    p = prefix.strip("/")
    if _CONTROL.search(p):
        raise VolumeConfigError(f"S3 prefix {prefix!r} contains control characters")
    if p and any(part in ("", ".", "..") for part in p.split("/")):
        raise VolumeConfigError(f"S3 prefix {prefix!r} has an empty, '.' or '..' path segment")
    if len(p.encode("utf-8")) > MAX_PREFIX_BYTES:
        raise VolumeConfigError(f"S3 prefix is longer than {MAX_PREFIX_BYTES} bytes")
    return p


def segment_object_key(prefix: str, volume_id: str, segment_id: int, scope: str = "") -> str:
    """S3 object key of a segment: ``<prefix>/<encoded volume id>/seg-<id>``, or with a
    ``scope`` (the owning catalog's id) ``<prefix>/<encoded volume id>/<scope>/seg-<id>``.

    Raises:
        VolumeConfigError: if the key would exceed 1024 UTF-8 bytes.
    """
    p = normalize_prefix(prefix)
    vol = encode_component(volume_id)
    key = f"{vol}/{encode_component(scope)}/seg-{segment_id:012d}" if scope else f"{vol}/seg-{segment_id:012d}"
    if p:
        key = f"{p}/{key}"
    if len(key.encode("utf-8")) > MAX_OBJECT_KEY_BYTES:
        raise VolumeConfigError(f"object key for volume {volume_id!r} exceeds {MAX_OBJECT_KEY_BYTES} bytes")
    return key


def owner_object_key(prefix: str, volume_id: str) -> str:
    """S3 object key of a volume's owner marker: ``<prefix>/<encoded volume id>/owner``
    (its body is the id of the catalog that owns the volume's prefix)."""
    p = normalize_prefix(prefix)
    key = f"{encode_component(volume_id)}/owner"
    return f"{p}/{key}" if p else key


def segment_file_name(segment_id: int) -> str:
    """File name of a segment inside its volume directory."""
    return f"seg-{segment_id:012d}.kvs"


def parse_segment_name(name: str) -> int | None:
    """Inverse of :func:`segment_file_name` / the last part of :func:`segment_object_key`."""
    m = re.fullmatch(r"seg-(\d{12,})(?:\.kvs)?", name.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def validate_block_key(key: BlockKey) -> None:
    """Raise InvalidRequestError unless ``key`` has a str namespace and a u64 sequence hash."""
    if not isinstance(key, BlockKey):
        raise InvalidRequestError(f"expected a BlockKey, got {type(key).__name__}")
    if not isinstance(key.namespace, str) or not key.namespace:
        raise InvalidRequestError(f"block key namespace must be a non-empty string: {key!r}")
    h = key.sequence_hash
    if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= U64_MAX:
        raise InvalidRequestError(f"sequence hash must be an unsigned 64-bit int: {key!r}")


def validate_block_keys(keys: Sequence[BlockKey]) -> list[int] | None:
    """:func:`validate_block_key` of every key of ``keys`` (the same checks and errors).

    Lists of plain keys (exactly ``BlockKey``, ``str`` namespaces, ``int`` hashes) are
    checked a column at a time (type sets, ``min``/``max``: ~0.15 us a key instead of
    ~0.7 us); anything else is checked key by key, so the error names the first bad key
    as before.

    Returns:
        the keys' sequence hashes when every key is plain, else ``None`` (valid keys of
        other types: ``BlockKey`` subclasses, ``str`` / ``int`` subclasses).

    Raises:
        InvalidRequestError: a key is not a valid :class:`BlockKey`.
    """
    hashes = _plain_hashes(keys)
    if hashes is None:
        for k in keys:
            validate_block_key(k)
    return hashes


def _plain_hashes(keys: Sequence[BlockKey]) -> list[int] | None:
    """The sequence hashes of ``keys`` if every key is an exact ``BlockKey`` with a
    non-empty exact ``str`` namespace and an exact ``int`` hash in [0, 2**64), else
    ``None`` (then they are checked one by one)."""
    if not keys or set(map(type, keys)) != {BlockKey}:
        return None
    hashes = [k.sequence_hash for k in keys]
    if set(map(type, hashes)) != {int} or min(hashes) < 0 or max(hashes) > U64_MAX:
        return None
    spaces = {k.namespace for k in keys}
    return hashes if all(type(ns) is str and ns for ns in spaces) else None


def u64_to_i64(v: int) -> int:
    """Two's-complement view of a u64 (SQLite INTEGER is signed 64-bit)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def i64_to_u64(v: int) -> int:
    """Inverse of :func:`u64_to_i64`."""
    return v + (1 << 64) if v < 0 else v
