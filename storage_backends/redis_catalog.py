"""Redis placement catalog (scaled mode): the same contract as ``SqliteCatalog``.

Every read-modify-write is one Lua script, so it is atomic on the server: a move's
compare-and-set and a concurrent put or delete of the same key are serialized by Redis
and never both win (docs/design.md §6, §7).  Segment ids come from ``INCR`` (unique, never
reused); live bytes/blocks per segment are counters the scripts keep exact.

Keys (``B`` = ``{<prefix>}:``; the hash tag keeps every key of one catalog in one Redis
Cluster slot, which multi-key scripts need):

===========================  ======  ==================================================
``B pl``                     hash    block id -> placement record
``B segid``                  string  last allocated segment id
``B seg:<id>``               hash    ``vol size sealed created live_bytes live_blocks``
``B segk:<id>``              zset    block ids of the live placements, score = offset
``B vseg:<volume>``          zset    segment ids of a volume, score = id
``B vused:<volume>``         string  sum of the sizes of a volume's segments
``B vol``                    hash    volume id -> descriptor spec
``B quarantine``             list    JSON records of quarantined placements
``B fence:<name>``           string  highest fencing token seen for ``name`` (``Fence``)
===========================  ======  ==================================================

A block id is ``<sequence hash as 16 hex digits><namespace>`` (fixed-width head, so it is
injective).  A placement record is ``volume US segment US offset US length US checksum US
version`` (``US`` = ``\\x1f``; volume ids never hold control characters, see
``keys.validate_volume_id``); numbers are decimal, checksums stay strings in Lua (u64
does not fit a Lua double).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from .catalog import PlacementCatalog
from .keys import validate_block_key, validate_block_keys, validate_volume_id
from .types import (
    BlockKey,
    Fence,
    FencedError,
    InvalidRequestError,
    Placement,
    SegmentInfo,
    StorageError,
    VersionConflictError,
    VolumeConfigError,
    VolumeFullError,
)

_US = "\x1f"

_LUA_LIB = r"""
local B = ARGV[1]
local function split(s)
  local out, pos = {}, 1
  while true do
    local i = string.find(s, '\031', pos, true)
    if not i then out[#out + 1] = string.sub(s, pos); return out end
    out[#out + 1] = string.sub(s, pos, i - 1)
    pos = i + 1
  end
end
local function seg_ok(seg, vol)
  return redis.call('HGET', B .. 'seg:' .. seg, 'vol') == vol
end
local function unlink(kid, f)
  -- f = parsed record: remove the block from its segment's accounting
  local sk = B .. 'seg:' .. f[2]
  if redis.call('ZREM', B .. 'segk:' .. f[2], kid) == 1 and redis.call('EXISTS', sk) == 1 then
    redis.call('HINCRBY', sk, 'live_bytes', -tonumber(f[4]))
    redis.call('HINCRBY', sk, 'live_blocks', -1)
  end
end
local function link(kid, seg, off, len)
  redis.call('ZADD', B .. 'segk:' .. seg, off, kid)
  redis.call('HINCRBY', B .. 'seg:' .. seg, 'live_bytes', len)
  redis.call('HINCRBY', B .. 'seg:' .. seg, 'live_blocks', 1)
end
"""

# ARGV: B, n, then n x (kid, vol, seg, off, len, ck, ver).  Returns per item the stored
# record when the key was already there (or earlier in the batch), else ''.
_INSERT = _LUA_LIB + r"""
local n = tonumber(ARGV[2])
local out, batch, checked = {}, {}, {}
for i = 0, n - 1 do
  local j = 3 + i * 7
  local kid = ARGV[j]
  local cur = redis.call('HGET', B .. 'pl', kid) or batch[kid]
  if cur then
    out[i + 1] = cur
  else
    local seg, vol = ARGV[j + 2], ARGV[j + 1]
    local ck = seg .. '\031' .. vol
    if not checked[ck] then
      if not seg_ok(seg, vol) then return redis.error_reply('NOSEG ' .. seg) end
      checked[ck] = true
    end
    batch[kid] = table.concat({vol, seg, ARGV[j + 3], ARGV[j + 4], ARGV[j + 5], ARGV[j + 6]}, '\031')
    out[i + 1] = ''
  end
end
local done = {}
for i = 0, n - 1 do
  local j = 3 + i * 7
  local kid = ARGV[j]
  if out[i + 1] == '' and not done[kid] then
    done[kid] = true
    redis.call('HSET', B .. 'pl', kid, batch[kid])
    link(kid, ARGV[j + 2], ARGV[j + 3], tonumber(ARGV[j + 4]))
  end
end
return out
"""

# A fence value is "<token>" (epoch 0) or "<epoch>:<token>"; fences compare by (epoch, token).
_FENCE_LIB = r"""
local function fence_get(fk)
  local v = redis.call('GET', fk)
  if not v then return -1, -1 end
  local e, t = string.match(v, '^(%d+):(%d+)$')
  if e then return tonumber(e), tonumber(t) end
  return 0, tonumber(v)
end
local function fence_put(fk, e, t)
  if e == 0 then redis.call('SET', fk, string.format('%d', t))
  else redis.call('SET', fk, string.format('%d:%d', e, t)) end
end
"""

# ARGV: B, kid, exp_ver, exp_vol, exp_seg, vol, seg, off, len, ck, fence name ('' = none), token, epoch
_CAS = _LUA_LIB + _FENCE_LIB + r"""
local kid = ARGV[2]
if ARGV[11] ~= '' then
  local fk = B .. 'fence:' .. ARGV[11]
  local ce, ct = fence_get(fk)
  local e, t = tonumber(ARGV[13]), tonumber(ARGV[12])
  if ce > e or (ce == e and ct > t) then return {'FENCED', string.format('%d:%d', ce, ct)} end
  if ce < e or ct < t then fence_put(fk, e, t) end
end
local cur = redis.call('HGET', B .. 'pl', kid)
if not cur then return {'GONE', ''} end
local f = split(cur)
if f[6] ~= ARGV[3] or f[1] ~= ARGV[4] or f[2] ~= ARGV[5] then return {'CONFLICT', cur} end
if not seg_ok(ARGV[7], ARGV[6]) then return {'NOSEG', ''} end
local rec = table.concat({ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10],
                          string.format('%d', tonumber(f[6]) + 1)}, '\031')
unlink(kid, f)
redis.call('HSET', B .. 'pl', kid, rec)
link(kid, ARGV[7], ARGV[8], tonumber(ARGV[9]))
return {'OK', rec}
"""

# ARGV: B, fence name, token, epoch.  Returns the stored token after raising it (never
# lowered), or 2**53 when the stored epoch is higher than the caller's.
_FENCE = _FENCE_LIB + r"""
local fk = ARGV[1] .. 'fence:' .. ARGV[2]
local ce, ct = fence_get(fk)
local e, t = tonumber(ARGV[4]), tonumber(ARGV[3])
if ce > e then return '9007199254740992' end
if ce < e or ct < t then fence_put(fk, e, t); return string.format('%d', t) end
return string.format('%d', ct)
"""

# ARGV: B, expected_version ('' = any), kid...   Returns per kid the removed record or ''
# ({'CONFLICT', cur} when a version was expected and differs; nothing removed then).
_DELETE = _LUA_LIB + r"""
local exp = ARGV[2]
local out = {}
for j = 3, #ARGV do
  local kid = ARGV[j]
  local cur = redis.call('HGET', B .. 'pl', kid)
  if cur then
    local f = split(cur)
    if exp ~= '' and f[6] ~= exp then return {'CONFLICT', cur} end
    unlink(kid, f)
    redis.call('HDEL', B .. 'pl', kid)
    out[#out + 1] = cur
  else
    out[#out + 1] = ''
  end
end
return out
"""

# ARGV: B, kid, record, reason-json
_QUARANTINE = _LUA_LIB + r"""
local cur = redis.call('HGET', B .. 'pl', ARGV[2])
if cur ~= ARGV[3] then return 0 end
unlink(ARGV[2], split(cur))
redis.call('HDEL', B .. 'pl', ARGV[2])
redis.call('RPUSH', B .. 'quarantine', ARGV[4])
return 1
"""

# ARGV: B, vol, size, capacity ('' = none), now.  Returns {id} or {-1, used}.
_NEW_SEGMENT = _LUA_LIB + r"""
local vol, size = ARGV[2], tonumber(ARGV[3])
local used = tonumber(redis.call('GET', B .. 'vused:' .. vol) or '0')
if ARGV[4] ~= '' and used + size > tonumber(ARGV[4]) then return {-1, used} end
local id = redis.call('INCR', B .. 'segid')
local sid = string.format('%d', id)
redis.call('HSET', B .. 'seg:' .. sid, 'vol', vol, 'size', ARGV[3], 'sealed', '0', 'created', ARGV[5],
           'live_bytes', '0', 'live_blocks', '0')
redis.call('ZADD', B .. 'vseg:' .. vol, id, sid)
redis.call('INCRBY', B .. 'vused:' .. vol, size)
return {id, used}
"""

# ARGV: B, vol, seg
_SEAL = _LUA_LIB + r"""
if seg_ok(ARGV[3], ARGV[2]) then redis.call('HSET', B .. 'seg:' .. ARGV[3], 'sealed', '1') end
return 0
"""

# ARGV: B, vol, seg, mode ('any' | 'if_empty_sealed').  Returns 1 dropped, 0 not,
# -n when n live blocks remain (mode 'any').
_DROP_SEGMENT = _LUA_LIB + r"""
local vol, seg = ARGV[2], ARGV[3]
local sk = B .. 'seg:' .. seg
if not seg_ok(seg, vol) then return 0 end
local live = tonumber(redis.call('HGET', sk, 'live_blocks'))
if live > 0 then
  if ARGV[4] == 'any' then return -live end
  return 0
end
if ARGV[4] ~= 'any' and redis.call('HGET', sk, 'sealed') ~= '1' then return 0 end
local size = tonumber(redis.call('HGET', sk, 'size'))
redis.call('DEL', sk, B .. 'segk:' .. seg)
redis.call('ZREM', B .. 'vseg:' .. vol, seg)
redis.call('DECRBY', B .. 'vused:' .. vol, size)
return 1
"""

# ARGV: B, vol.  Every segment of vol as flat {id, size, live_bytes, live_blocks, sealed, created}.
_SEGMENTS = _LUA_LIB + r"""
local out = {}
for _, seg in ipairs(redis.call('ZRANGE', B .. 'vseg:' .. ARGV[2], 0, -1)) do
  local h = redis.call('HMGET', B .. 'seg:' .. seg, 'size', 'live_bytes', 'live_blocks', 'sealed', 'created')
  out[#out + 1] = seg
  for k = 1, 5 do out[#out + 1] = h[k] end
end
return out
"""

# ARGV: B, vol, seg ('' = every segment of vol).  Flat {kid, record} ordered by (segment, offset).
_ITER = _LUA_LIB + r"""
local segs
if ARGV[3] == '' then
  segs = redis.call('ZRANGE', B .. 'vseg:' .. ARGV[2], 0, -1)
elseif seg_ok(ARGV[3], ARGV[2]) then
  segs = {ARGV[3]}
else
  segs = {}
end
local out = {}
for _, seg in ipairs(segs) do
  local kids = redis.call('ZRANGE', B .. 'segk:' .. seg, 0, -1)
  if #kids > 0 then
    local recs = redis.call('HMGET', B .. 'pl', unpack(kids))
    for k = 1, #kids do
      if recs[k] then out[#out + 1] = kids[k]; out[#out + 1] = recs[k] end
    end
  end
end
return out
"""

# ARGV: B, vol.  Returns -n when n blocks still live there, else 1 after forgetting it.
_FORGET = _LUA_LIB + r"""
local vol = ARGV[2]
local segs = redis.call('ZRANGE', B .. 'vseg:' .. vol, 0, -1)
local n = 0
for _, seg in ipairs(segs) do n = n + tonumber(redis.call('HGET', B .. 'seg:' .. seg, 'live_blocks') or '0') end
if n > 0 then return -n end
for _, seg in ipairs(segs) do redis.call('DEL', B .. 'seg:' .. seg, B .. 'segk:' .. seg) end
redis.call('DEL', B .. 'vseg:' .. vol, B .. 'vused:' .. vol)
redis.call('HDEL', B .. 'vol', vol)
return 1
"""


def _kid(key: BlockKey) -> str:
    return f"{key.sequence_hash:016x}{key.namespace}"


def _key_of(kid: str) -> BlockKey:
    return BlockKey(kid[16:], int(kid[:16], 16))


def _record(p: Placement, version: int | None = None) -> str:
    v = p.version if version is None else version
    return _US.join((p.volume_id, str(p.segment_id), str(p.offset), str(p.length), str(p.checksum), str(v)))


def _placement(key: BlockKey, rec: str) -> Placement:
    vol, seg, off, ln, ck, ver = rec.split(_US)
    return Placement(key, vol, int(seg), int(off), int(ln), int(ck), int(ver))


class RedisCatalog(PlacementCatalog):
    """Placement catalog on a Redis server (scaled mode).

    Args:
        url: Redis URL (``redis://host:port/db``).
        prefix: key prefix of this catalog (no ``{``/``}``); several catalogs can share
            one Redis with different prefixes.
        socket_timeout_s: per-command socket timeout.

    Thread-safe (the redis-py connection pool is).  Raises :class:`StorageError` when the
    server cannot be reached.
    """

    def __init__(self, url: str, prefix: str = "kvadvisor:catalog", socket_timeout_s: float = 30.0) -> None:
        import redis

        if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
            raise InvalidRequestError(f"Redis catalog prefix must be a non-empty string without braces, got {prefix!r}")
        self.url = url
        self.prefix = prefix
        self._b = "{" + prefix + "}:"
        self._redis_errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError,)
        self._client: Any = redis.Redis.from_url(url, decode_responses=True, socket_timeout=socket_timeout_s)
        self._lock = threading.Lock()
        self._scripts = {
            name: self._client.register_script(src)
            for name, src in (
                ("insert", _INSERT), ("cas", _CAS), ("fence", _FENCE), ("delete", _DELETE), ("quarantine", _QUARANTINE),
                ("new_segment", _NEW_SEGMENT), ("seal", _SEAL), ("drop", _DROP_SEGMENT),
                ("segments", _SEGMENTS), ("iter", _ITER), ("forget", _FORGET),
            )
        }
        self._call(lambda c: c.ping())

    def catalog_id(self) -> str:
        """See :meth:`PlacementCatalog.catalog_id` (key ``<prefix>:catalog_id``, set once)."""
        import uuid

        key = self._b + "catalog_id"
        self._call(lambda c: c.set(key, uuid.uuid4().hex, nx=True))
        return str(self._call(lambda c: c.get(key)))

    # ------------------------------------------------------------------ plumbing
    @property
    def client(self) -> Any:
        """The ``redis.Redis`` client (raises StorageError once closed)."""
        c = self._client
        if c is None:
            raise StorageError("catalog is closed")
        return c

    def _call(self, fn: Any) -> Any:
        c = self.client
        try:
            return fn(c)
        except self._redis_errors as exc:
            if str(exc).startswith("NOSEG"):
                raise StorageError(f"a placement names segment {str(exc)[6:]}, which the catalog does not hold") from exc
            raise StorageError(f"Redis catalog {self.url} ({self.prefix}): {exc}") from exc

    def _run(self, name: str, *args: object) -> Any:
        script = self._scripts[name]
        return self._call(lambda c: script(keys=[self._b + "pl"], args=[self._b, *args], client=c))

    # ------------------------------------------------------------------ placements
    def get(self, key: BlockKey) -> Placement | None:
        """See :meth:`PlacementCatalog.get`."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[BlockKey]) -> list[Placement | None]:
        """See :meth:`PlacementCatalog.get_many` (one ``HMGET``: a consistent snapshot)."""
        validate_block_keys(keys)
        if not keys:
            self.client  # noqa: B018 - raises when closed
            return []
        recs = self._call(lambda c: c.hmget(self._b + "pl", [_kid(k) for k in keys]))
        return [_placement(k, r) if r is not None else None for k, r in zip(keys, recs)]

    def insert_if_absent(self, placements: Sequence[Placement]) -> list[Placement]:
        """See :meth:`PlacementCatalog.insert_if_absent` (one script: atomic for the batch)."""
        args: list[object] = [len(placements)]
        for p in placements:
            validate_block_key(p.key)
            args += [_kid(p.key), p.volume_id, p.segment_id, p.offset, p.length, p.checksum, p.version]
        if not placements:
            return []
        got = self._run("insert", *args)
        return [p if r == "" else _placement(p.key, r) for p, r in zip(placements, got)]

    def raise_fence(self, fence: Fence) -> int:
        """See :meth:`PlacementCatalog.raise_fence` (key ``<prefix>:fence:<name>``, one script)."""
        return int(self._run("fence", fence.name, fence.token, fence.epoch))

    def compare_and_set(self, expected: Placement, new: Placement, fence: Fence | None = None) -> Placement:
        """See :meth:`PlacementCatalog.compare_and_set` (one script: atomic, fence included)."""
        validate_block_key(expected.key)
        if new.key != expected.key:
            raise InvalidRequestError(f"compare_and_set of {expected.key} with a placement of {new.key}")
        status, rec = self._run(
            "cas", _kid(expected.key), expected.version, expected.volume_id, expected.segment_id,
            new.volume_id, new.segment_id, new.offset, new.length, new.checksum,
            fence.name if fence is not None else "", fence.token if fence is not None else 0,
            fence.epoch if fence is not None else 0,
        )
        if status == "FENCED":
            assert fence is not None
            epoch, _, token = str(rec).partition(":")
            raise FencedError(f"fence {fence.name!r} is at token {token} (epoch {epoch}), above this writer's "
                              f"{fence.token} (epoch {fence.epoch}): a newer lease holder acts on it")
        if status == "GONE":
            raise VersionConflictError(f"{expected.key} was deleted (expected version {expected.version})")
        if status == "CONFLICT":
            cur = _placement(expected.key, rec)
            raise VersionConflictError(
                f"{expected.key} is at version {cur.version} on {cur.volume_id!r}/{cur.segment_id}, "
                f"expected version {expected.version} on {expected.volume_id!r}/{expected.segment_id}"
            )
        if status == "NOSEG":
            raise StorageError(
                f"placement of {new.key} names segment {new.segment_id} of volume {new.volume_id!r}, "
                "which the catalog does not hold"
            )
        return _placement(expected.key, rec)

    def delete(self, key: BlockKey, expected_version: int | None = None) -> Placement | None:
        """See :meth:`PlacementCatalog.delete`."""
        validate_block_key(key)
        exp = "" if expected_version is None else str(expected_version)
        got = self._run("delete", exp, _kid(key))
        if len(got) == 2 and got[0] == "CONFLICT":
            cur = _placement(key, got[1])
            raise VersionConflictError(f"{key} is at version {cur.version}, expected {expected_version}")
        return _placement(key, got[0]) if got[0] else None

    def delete_many(self, keys: Sequence[BlockKey]) -> list[Placement | None]:
        """See :meth:`PlacementCatalog.delete_many` (one script)."""
        validate_block_keys(keys)
        if not keys:
            return []
        got = self._run("delete", "", *[_kid(k) for k in keys])
        return [_placement(k, r) if r else None for k, r in zip(keys, got)]

    def _iter(self, volume_id: str, segment_id: int | None) -> Iterator[Placement]:
        flat = self._run("iter", volume_id, "" if segment_id is None else segment_id)
        return iter([_placement(_key_of(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)])

    def iter_volume(self, volume_id: str) -> Iterator[Placement]:
        """See :meth:`PlacementCatalog.iter_volume` (one consistent, materialized snapshot)."""
        return self._iter(volume_id, None)

    def iter_segment(self, volume_id: str, segment_id: int) -> Iterator[Placement]:
        """See :meth:`PlacementCatalog.iter_segment`."""
        return self._iter(volume_id, segment_id)

    def quarantine(self, placement: Placement, reason: str) -> bool:
        """See :meth:`PlacementCatalog.quarantine`."""
        validate_block_key(placement.key)
        note = json.dumps({"kid": _kid(placement.key), "rec": _record(placement), "reason": reason, "at": time.time()})
        return bool(self._run("quarantine", _kid(placement.key), _record(placement), note))

    def quarantined(self) -> list[tuple[Placement, str]]:
        """Every quarantined placement with the reason, oldest first."""
        raw = self._call(lambda c: c.lrange(self._b + "quarantine", 0, -1))
        out = []
        for r in raw:
            d = json.loads(r)
            out.append((_placement(_key_of(d["kid"]), d["rec"]), str(d["reason"])))
        return out

    # ------------------------------------------------------------------ segments
    def new_segment(self, volume_id: str, size_bytes: int, *, capacity_bytes: int | None = None) -> int:
        """See :meth:`PlacementCatalog.new_segment` (``INCR`` id, capacity checked atomically)."""
        if size_bytes < 0:
            raise InvalidRequestError(f"segment size must be >= 0, got {size_bytes}")
        try:
            validate_volume_id(volume_id)
        except VolumeConfigError as exc:
            raise InvalidRequestError(str(exc)) from exc
        seg, used = self._run("new_segment", volume_id, size_bytes,
                              "" if capacity_bytes is None else capacity_bytes, repr(time.time()))
        if int(seg) < 0:
            raise VolumeFullError(
                f"volume {volume_id!r}: {size_bytes} more bytes would exceed its capacity "
                f"({used} of {capacity_bytes} bytes used)"
            )
        return int(seg)

    def seal_segment(self, volume_id: str, segment_id: int) -> None:
        """See :meth:`PlacementCatalog.seal_segment`."""
        self._run("seal", volume_id, segment_id)

    def segments(self, volume_id: str) -> list[SegmentInfo]:
        """See :meth:`PlacementCatalog.segments` (one consistent snapshot)."""
        flat = self._run("segments", volume_id)
        return [
            SegmentInfo(int(flat[i]), volume_id, int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]),
                        flat[i + 4] == "1", float(flat[i + 5]))
            for i in range(0, len(flat), 6)
        ]

    def segment(self, volume_id: str, segment_id: int) -> SegmentInfo | None:
        """See :meth:`PlacementCatalog.segment`."""
        h = self._call(lambda c: c.hgetall(f"{self._b}seg:{segment_id}"))
        if not h or h.get("vol") != volume_id:
            return None
        return SegmentInfo(segment_id, volume_id, int(h["size"]), int(h["live_bytes"]), int(h["live_blocks"]),
                           h["sealed"] == "1", float(h["created"]))

    def drop_segment(self, volume_id: str, segment_id: int) -> bool:
        """See :meth:`PlacementCatalog.drop_segment`."""
        r = int(self._run("drop", volume_id, segment_id, "any"))
        if r < 0:
            raise StorageError(f"segment {segment_id} of {volume_id!r} still holds {-r} live blocks")
        return r == 1

    def drop_segment_if_empty(self, volume_id: str, segment_id: int) -> bool:
        """See :meth:`PlacementCatalog.drop_segment_if_empty`."""
        return int(self._run("drop", volume_id, segment_id, "if_empty_sealed")) == 1

    # ------------------------------------------------------------------ volumes
    def record_volume(self, volume_id: str, spec: str) -> str:
        """See :meth:`PlacementCatalog.record_volume` (``HSETNX``: first writer wins)."""
        def op(c: Any) -> str:
            c.hsetnx(self._b + "vol", volume_id, spec)
            return str(c.hget(self._b + "vol", volume_id))

        return str(self._call(op))

    def forget_volume(self, volume_id: str) -> None:
        """See :meth:`PlacementCatalog.forget_volume`."""
        r = int(self._run("forget", volume_id))
        if r < 0:
            raise StorageError(f"volume {volume_id!r} still holds {-r} blocks")

    def volume_specs(self) -> dict[str, str]:
        """See :meth:`PlacementCatalog.volume_specs`."""
        d = self._call(lambda c: c.hgetall(self._b + "vol"))
        return {str(k): str(v) for k, v in sorted(d.items())}

    # ------------------------------------------------------------------ admin
    def destroy(self) -> int:
        """Delete every key of this catalog (tests, decommissioning); returns keys deleted."""
        def op(c: Any) -> int:
            n = 0
            batch: list[str] = []
            pattern = re.sub(r"([\\*?\[\]])", r"\\\1", self._b) + "*"
            for k in c.scan_iter(match=pattern, count=1000):
                batch.append(k)
                if len(batch) >= 500:
                    n += int(c.delete(*batch))
                    batch = []
            if batch:
                n += int(c.delete(*batch))
            return n

        return int(self._call(op))

    def close(self) -> None:
        """See :meth:`PlacementCatalog.close`."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
