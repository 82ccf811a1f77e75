"""S3 volume: one object per segment, written and read through NIXL OBJ.

Object key: ``<prefix>/<encoded volume id>/<catalog id>/seg-<id>`` (``keys.segment_object_key``,
injective, <= 1024 bytes).  The data path is NIXL OBJ (a WRITE of one descriptor creates
the object, and the segments of one put go as one WRITE of several descriptors: PUTs run
concurrently; READs are ranged GETs, several per transfer).  boto3 is used only for
bucket creation, a ``HEAD`` of a segment after a failed read (is it there, how long),
listing and deletes, with tenacity retries on 5xx, throttling and connection errors.  Credentials come from the descriptor or, when it
has none, from the standard AWS chain as boto3 resolves it; NIXL gets the same ones.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlparse

import numpy as np
import torch
from tenacity import RetryCallState, retry, retry_if_exception, stop_after_attempt, wait_exponential

from .gcpause import gc_pause_yield
from .keys import MAX_OBJECT_KEY_BYTES, normalize_prefix, owner_object_key, parse_segment_name, segment_object_key
from .nixl_engine import NixlEngine
from .types import (
    InvalidRequestError,
    S3EndpointUnreachableError,
    TransferError,
    VolumeConfigError,
    VolumeDescriptor,
    VolumeKind,
)
from .volume import Volume

logger = logging.getLogger(__name__)

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_RETRY_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "503", "500", "502", "504",
})
T = TypeVar("T")


def _retryable(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError, ConnectionError as BotoConnectionError, EndpointConnectionError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return status >= 500 or str(err.get("Code", "")) in _RETRY_CODES
    return isinstance(exc, (BotoConnectionError, EndpointConnectionError, TransferError))


def _with_retries(
    fn: Callable[[], T], attempts: int = 4, on_retry: Callable[[BaseException, int], None] | None = None
) -> T:
    """Run ``fn`` with exponential backoff (50 ms, 100 ms, ... capped at 2 s) on retryable
    S3 errors (5xx, throttling, timeouts, connection errors) and failed NIXL transfers.

    Args:
        attempts: total tries.
        on_retry: called with ``(error, attempt number)`` before each backoff sleep.

    Raises:
        the last error once ``attempts`` tries failed, or the first non-retryable one.
    """

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            exc = state.outcome.exception()
            if exc is not None:
                on_retry(exc, state.attempt_number)

    return retry(
        retry=retry_if_exception(_retryable),
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.05, max=2.0),
        before_sleep=before_sleep,
        reraise=True,
    )(fn)()


def _credentials(desc: VolumeDescriptor) -> tuple[str, str, str | None]:
    """``(access_key, secret_key, session_token)`` from the descriptor or the AWS chain."""
    if desc.access_key and desc.secret_key:
        return desc.access_key, desc.secret_key, None
    if desc.access_key or desc.secret_key:
        raise VolumeConfigError(f"s3 volume {desc.id!r}: give both access_key and secret_key, or neither")
    import boto3

    creds = boto3.Session().get_credentials()
    if creds is None:
        raise VolumeConfigError(
            f"s3 volume {desc.id!r}: no credentials (set access_key/secret_key or the standard AWS "
            "environment variables / shared config)"
        )
    frozen = creds.get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token


def probe_s3(desc: VolumeDescriptor, timeout_s: float = 3.0) -> None:
    """Whether an S3 volume's endpoint answers at all: one ``HEAD`` of its bucket, at most
    ``timeout_s`` seconds to connect and as much to read, no retry. Any S3 answer counts
    (a missing bucket too: opening the volume creates it; a refusal is reported by the open).

    Run it before opening a volume on a path that must not wait long: opening retries with
    the client's default timeouts (60 s each), so a silent endpoint (one that accepts TCP
    and never answers) holds the caller for tens of seconds.

    Raises:
        S3EndpointUnreachableError: no connection, or no answer within ``timeout_s``.
        VolumeConfigError: no credentials.
    """
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    ak, sk, token = _credentials(desc)
    client = boto3.client(
        "s3", endpoint_url=desc.endpoint, region_name=desc.region,
        aws_access_key_id=ak, aws_secret_access_key=sk, aws_session_token=token,
        config=Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                      retries={"total_max_attempts": 1, "mode": "standard"}, s3={"addressing_style": "path"}),
    )
    try:
        client.head_bucket(Bucket=desc.bucket)
    except ClientError:
        return  # an answer
    except Exception as exc:  # noqa: BLE001 - timeouts and connection errors of every kind
        raise S3EndpointUnreachableError(desc.id, desc.endpoint,
                                         f"no answer within {timeout_s:g} s: {type(exc).__name__}") from exc
    finally:
        client.close()


class S3Volume(Volume):
    """Segments as objects in an S3 bucket (NIXL OBJ backend)."""

    kind: ClassVar[VolumeKind] = VolumeKind.S3

    def __init__(self, desc: VolumeDescriptor, engine: NixlEngine) -> None:
        super().__init__(desc, engine)
        import boto3
        from botocore.config import Config

        ak, sk, token = _credentials(desc)
        self.prefix = normalize_prefix(desc.prefix)
        self.client = boto3.client(
            "s3", endpoint_url=desc.endpoint, region_name=desc.region,
            aws_access_key_id=ak, aws_secret_access_key=sk, aws_session_token=token,
            config=Config(connect_timeout=desc.s3_connect_timeout_s, read_timeout=desc.s3_read_timeout_s,
                          retries={"total_max_attempts": 1, "mode": "standard"},  # tenacity retries
                          s3={"addressing_style": "path"}),
        )
        self._lock = threading.Lock()
        self.scope = ""
        """The owning catalog's id once :meth:`bind_catalog` ran (part of every segment key)."""
        self._ensure_bucket()

    def bind_catalog(self, catalog_id: str | None) -> None:
        """Claim ``<prefix>/<volume>/`` for ``catalog_id`` and scope the segment keys with it.

        The claim is an owner object (``<prefix>/<volume>/owner``, body: the catalog id)
        written with a conditional PUT (``If-None-Match: *``), so of two deployments that
        race for one bucket and prefix exactly one wins; the other, and any later one with
        another catalog, is refused.  Segment keys then read
        ``<prefix>/<volume>/<catalog id>/seg-<id>``.

        Raises:
            VolumeConfigError: the prefix is owned by another catalog, or the claim failed.
        """
        if not catalog_id:
            return
        from botocore.exceptions import ClientError

        key = owner_object_key(self.desc.prefix, self.desc.id)
        bucket = self.desc.bucket
        try:
            self._retry(lambda: self.client.put_object(Bucket=bucket, Key=key, Body=catalog_id.encode(), IfNoneMatch="*"))
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code not in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise VolumeConfigError(f"s3 volume {self.desc.id!r}: cannot claim s3://{bucket}/{key}: {exc}") from exc
        except Exception as exc:
            raise VolumeConfigError(f"s3 volume {self.desc.id!r}: cannot claim s3://{bucket}/{key}: {exc}") from exc
        try:  # read back: also where a store ignores If-None-Match, the first writer's id wins
            owner = self._retry(lambda: self.client.get_object(Bucket=bucket, Key=key)["Body"].read()).decode(errors="replace")
        except Exception as exc:
            raise VolumeConfigError(f"s3 volume {self.desc.id!r}: cannot read s3://{bucket}/{key}: {exc}") from exc
        if owner != catalog_id:
            raise VolumeConfigError(
                f"s3 volume {self.desc.id!r}: s3://{bucket}/{key.rsplit('/', 1)[0]}/ is owned by catalog {owner!r}, "
                f"not this catalog ({catalog_id!r}): another deployment writes there; use another bucket or prefix")
        self.scope = catalog_id

    #: total tries of one S3 call or NIXL OBJ transfer (backoff between them)
    attempts: int = 4

    def _retry(self, fn: Callable[[], T], attempts: int | None = None, quiet: bool = False) -> T:
        """:func:`_with_retries` counting ``s3_retries`` and logging each retry (``quiet``: at
        INFO, for a probe whose final failure is raised with its cause anyway)."""

        def note(exc: BaseException, attempt: int) -> None:
            gc_pause_yield()  # a backoff: no reason to keep the collector paused
            self.counters.bump("s3_retries")
            logger.log(logging.INFO if quiet else logging.WARNING, "volume %s: S3 attempt %d failed, retrying: %s",
                       self.desc.id, attempt, exc)

        return _with_retries(fn, attempts or self.attempts, note)

    # ------------------------------------------------------------------ class-level
    @classmethod
    def validate(cls, desc: VolumeDescriptor) -> None:
        """An s3 volume needs an http(s) endpoint, a valid bucket name and a short prefix."""
        if not desc.endpoint:
            raise VolumeConfigError(f"s3 volume {desc.id!r} needs an endpoint (endpoint='http://host:port')")
        u = urlparse(desc.endpoint)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise VolumeConfigError(f"s3 volume {desc.id!r}: endpoint {desc.endpoint!r} is not an http(s) URL")
        if not desc.bucket:
            raise VolumeConfigError(f"s3 volume {desc.id!r} needs a bucket (bucket=...)")
        if not _BUCKET_RE.match(desc.bucket) or ".." in desc.bucket:
            raise VolumeConfigError(
                f"s3 volume {desc.id!r}: bucket {desc.bucket!r} is not a valid S3 bucket name "
                "(3-63 lowercase letters, digits, '.', '-')"
            )
        key = segment_object_key(desc.prefix, desc.id, 10**15, "f" * 32)  # with a catalog id as scope
        if len(key.encode("utf-8")) > MAX_OBJECT_KEY_BYTES:  # pragma: no cover - checked inside
            raise VolumeConfigError(f"s3 volume {desc.id!r}: object keys would exceed 1024 bytes")
        n = desc.s3_sdk_max_attempts
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise VolumeConfigError(f"s3 volume {desc.id!r}: s3_sdk_max_attempts must be an int >= 1 or None, got {n!r}")
        for name in ("s3_connect_timeout_s", "s3_read_timeout_s"):
            t = getattr(desc, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
                raise VolumeConfigError(f"s3 volume {desc.id!r}: {name} must be a number of seconds > 0, got {t!r}")

    #: aws-sdk-cpp request checksums of the NIXL OBJ backend: ``"required"`` computes them
    #: only for operations that need one, so a PUT is a plain signed body instead of an
    #: aws-chunked stream with a CRC trailer (3x faster against moto).  Integrity is end to
    #: end anyway: XXH3 per block, checked on every get.
    #: Set ``"supported"`` to have S3 verify a CRC of every upload as well.
    request_checksum: ClassVar[str] = "required"

    #: aws-sdk-cpp response checksums: ``"required"`` validates only when a request asks
    #: for it (ours never do): every block is checked with its XXH3 after the read.
    response_checksum: ClassVar[str] = "required"
    #: concurrent requests of the NIXL OBJ backend (its default is half the cores, 1 on a
    #: 2-core box): the segments of one read batch are fetched in parallel, and a put
    #: writes up to this many segment objects at once.
    threads: ClassVar[int] = 8
    #: a read batch is ONE transfer: a whole-span ranged GET per segment.  Cutting it
    #: into pieces costs a request per piece (about 10 ms each on moto) and measured
    #: 2x slower.
    read_piece_bytes: int = 1 << 62

    @classmethod
    def engine_spec(cls, desc: VolumeDescriptor) -> tuple[str, dict[str, str]]:
        """One OBJ backend per (endpoint, bucket, region, credentials)."""
        ak, sk, token = _credentials(desc)
        u = urlparse(desc.endpoint or "")
        params = {
            "endpoint_override": desc.endpoint or "",
            "bucket": desc.bucket or "",
            "region": desc.region,
            "scheme": u.scheme or "https",
            "access_key": ak,
            "secret_key": sk,
            "use_virtual_addressing": "false",
            "req_checksum": cls.request_checksum,
            "resp_checksum": cls.response_checksum,
            "num_threads": str(cls.threads),
        }
        if token:
            params["session_token"] = token
        return "OBJ", params

    @classmethod
    def engine_env(cls, desc: VolumeDescriptor) -> dict[str, str]:
        """With ``desc.s3_sdk_max_attempts`` set: ``AWS_RETRY_MODE=standard`` and
        ``AWS_MAX_ATTEMPTS`` (the aws-sdk-cpp client inside NIXL OBJ reads its retry
        strategy from them when it is created, and NIXL takes no parameter for it);
        otherwise nothing (the process environment or the SDK's default applies)."""
        if desc.s3_sdk_max_attempts is None:
            return {}
        return {"AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": str(desc.s3_sdk_max_attempts)}

    # ------------------------------------------------------------------ admin
    def _ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        bucket = self.desc.bucket
        try:
            self._retry(lambda: self.client.head_bucket(Bucket=bucket), quiet=True)  # the first contact
            return
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code not in ("404", "NoSuchBucket", "NotFound"):
                raise VolumeConfigError(f"s3 volume {self.desc.id!r}: bucket {bucket!r}: {exc}") from exc
        except Exception as exc:
            raise S3EndpointUnreachableError(self.desc.id, self.desc.endpoint, exc) from exc
        kwargs: dict[str, Any] = {"Bucket": bucket}
        if self.desc.region and self.desc.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.desc.region}
        try:
            self._retry(lambda: self.client.create_bucket(**kwargs))
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise VolumeConfigError(f"s3 volume {self.desc.id!r}: cannot create bucket {bucket!r}: {exc}") from exc

    def key(self, segment_id: int) -> str:
        """Object key of a segment."""
        return segment_object_key(self.prefix, self.desc.id, segment_id, self.scope)

    # ------------------------------------------------------------------ write
    def write_segment(self, segment_id: int, buffer: torch.Tensor, size: int) -> None:
        """See :meth:`Volume.write_segment` (one OBJ descriptor: one PUT)."""
        self.write_segments([(segment_id, np.array([[buffer.data_ptr(), size, 0]], dtype=np.int64), size)])

    def direct_write_ok(self, addrs: np.ndarray, lengths: np.ndarray, offsets: np.ndarray, size: int) -> bool:
        """When the blocks are ONE run contiguous in memory that fills the segment (a
        segment object is one PUT of one descriptor)."""
        if len(lengths) == 0 or int(lengths.sum()) != size:
            return False
        return len(lengths) == 1 or bool(np.all(addrs[1:] == addrs[:-1] + lengths[:-1]))

    def write_segment_from(self, segment_id: int, addrs: np.ndarray, lengths: np.ndarray, size: int) -> None:
        """See :meth:`Volume.write_segment_from` (one contiguous run: one PUT)."""
        self.write_segments([(segment_id, self.runs(addrs, lengths), size)])

    @property
    def write_concurrency(self) -> int:  # type: ignore[override]
        """Segment objects one :meth:`write_segments` call PUTs at once: :attr:`threads`."""
        return self.threads

    def write_segments(self, jobs: Sequence[tuple[int, np.ndarray, int]]) -> None:
        """See :meth:`Volume.write_segments`: ONE NIXL OBJ WRITE with one descriptor (one
        PUT of one object) per segment, run concurrently by the backend's
        :attr:`threads`; retried as a whole (the keys are new, so a PUT sent again is
        harmless); on failure every object of the call is deleted.

        A PUT that succeeds stored exactly its bytes: the request carries the body's
        ``Content-Length`` and S3 stores an object whole or not at all (no HEAD after it;
        a segment that later reads short or wrong is caught by the XXH3 of every block
        on every get, and quarantined, see :meth:`segment_size`).

        Raises:
            TransferError: a segment is not one contiguous run, or the transfer kept
                failing (the error of the last try).
        """
        if not jobs:
            return
        local = np.empty((len(jobs), 3), dtype=np.int64)
        keys: list[str] = []
        for j, (seg, runs, size) in enumerate(jobs):
            if len(runs) != 1 or int(runs[0, 1]) != size:
                raise TransferError(f"volume {self.desc.id!r}: segment {seg} is not one contiguous run of {size} bytes")
            local[j] = (int(runs[0, 0]), size, 0)
            keys.append(self.key(seg))

        def attempt() -> None:
            devs = [self.engine.new_dev_id() for _ in jobs]
            remote = np.zeros((len(jobs), 3), dtype=np.int64)
            remote[:, 1], remote[:, 2] = local[:, 1], devs
            regs = []
            try:
                for key, dev, (_, _, size) in zip(keys, devs, jobs):
                    regs.append(self.engine.register([(0, size, dev, key)], "OBJ"))
                self.engine.transfer("WRITE", local, remote, "OBJ")
            finally:
                for reg in regs:
                    self.engine.deregister(reg)

        try:
            self._retry(attempt)
        except BaseException as exc:
            for key in keys:
                self._delete_quietly(key)
            if isinstance(exc, TransferError):
                raise
            if isinstance(exc, Exception):
                segs = [seg for seg, _, _ in jobs]
                raise TransferError(f"volume {self.desc.id!r}: writing segments {segs} failed: {exc}") from exc
            raise
        self.counters.segments_written += len(jobs)
        self.counters.bytes_written += int(local[:, 1].sum())
        self.counters.bump("put_transfers")

    def _delete_quietly(self, key: str) -> None:
        try:
            self._retry(lambda: self.client.delete_object(Bucket=self.desc.bucket, Key=key))
        except Exception as exc:
            logger.warning("volume %s: cannot delete %s: %s", self.desc.id, key, exc)

    # ------------------------------------------------------------------ read
    #: ranges of one segment closer than this are fetched with one ranged GET
    coalesce_gap: int = 256 << 10

    def _spans(self, items: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int, list[int]]]:
        """Merge requested ranges into ``[(segment_id, start, end, item indexes)]``."""
        # by (segment, offset, length); ties of segment and offset may go in any order
        order = sorted(range(len(items)), key=items.__getitem__)
        spans: list[tuple[int, int, int, list[int]]] = []
        gap = self.coalesce_gap
        s_seg, s_end, idx = -1, 0, []  # the open span (segment ids are never negative)
        for i in order:
            seg, off, n = items[i]
            if seg == s_seg and off - s_end <= gap:
                idx.append(i)
                if off + n > s_end:
                    s_end = off + n
                    spans[-1] = (seg, spans[-1][1], s_end, idx)
            else:
                s_seg, s_end, idx = seg, off + n, [i]
                spans.append((seg, off, s_end, idx))
        return spans

    def read_buffer_bytes(self, items: Sequence[tuple[int, int, int]]) -> int:
        """Sum of the coalesced spans' lengths."""
        return sum(end - start for _, start, end, _ in self._spans(items))

    def read_many(self, items: Sequence[tuple[int, int, int]], out: torch.Tensor) -> list[torch.Tensor]:
        """See :meth:`Volume.read_many`: nearby ranges of a segment are coalesced, then every
        span is one ranged GET of a single NIXL READ."""
        return [out[s : s + n] for s, (_, _, n) in zip(self.read_into(items, out), items)]

    def read_into(self, items: Sequence[tuple[int, int, int]], out: torch.Tensor) -> list[int]:
        """See :meth:`Volume.read_into` (:meth:`read_many` without a view per item)."""
        spans = self._spans(items)
        need = sum(end - start for _, start, end, _ in spans)
        if need > out.numel():
            raise ValueError(f"read buffer of {out.numel()} bytes is smaller than the {need} needed")
        ends: dict[int, int] = {}
        for seg_id, _, end, _ in spans:
            ends[seg_id] = max(ends.get(seg_id, 0), end)
        devs = {seg_id: self.engine.new_dev_id() for seg_id in ends}
        starts = [0] * len(items)
        local: list[tuple[int, int]] = []
        remote: list[tuple[int, int, int]] = []
        pos = 0
        base = out.data_ptr()
        for seg_id, start, end, idx in spans:
            local.append((base + pos, end - start))
            remote.append((start, end - start, devs[seg_id]))
            shift = pos - start
            for i in idx:
                starts[i] = items[i][1] + shift
            pos += end - start
        self._read_objects(ends, devs, local, remote)
        self.counters.blocks_read += len(items)
        self.counters.bytes_read += pos
        self.counters.bump("ranged_gets", len(spans))
        return starts

    def _read_objects(self, ends: dict[int, int], devs: dict[int, int], local: Any, remote: Any) -> None:
        """Register segment objects ``ends`` (segment id -> bytes needed from its start) as
        NIXL OBJ devices ``devs``, run one READ of ``local`` <- ``remote`` descriptors
        (retried as a whole), then deregister them whatever happened.

        Raises:
            TransferError: the READ failed after every retry.
        """
        regs = []
        try:
            for seg_id, end in ends.items():
                regs.append(self.engine.register([(0, end, devs[seg_id], self.key(seg_id))], "OBJ"))
            self._retry(lambda: self.engine.transfer("READ", local, remote, "OBJ"))
        finally:
            for reg in regs:
                self.engine.deregister(reg)

    #: blocks at least this large are read straight into their destination, one ranged
    #: GET each (smaller ones are coalesced per segment into a staging buffer)
    direct_min_bytes: int = 4 << 20

    def direct_read_ok(self, addrs: np.ndarray, lengths: np.ndarray) -> bool:
        """When every block is at least :attr:`direct_min_bytes` long."""
        return bool(len(lengths)) and int(lengths.min()) >= self.direct_min_bytes

    def read_direct(self, segments: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray) -> None:
        """See :meth:`Volume.read_direct`: one ranged GET per range, all in one NIXL READ
        (run concurrently by the backend's threads), retried as a whole on failure."""
        seg_l = segments.tolist()
        ends: dict[int, int] = {}
        for seg_id, end in zip(seg_l, (offsets + lengths).tolist()):
            ends[seg_id] = max(ends.get(seg_id, 0), end)
        devs = {seg_id: self.engine.new_dev_id() for seg_id in ends}
        local = np.stack([addrs, lengths, np.zeros_like(lengths)], axis=1)
        remote = np.stack([offsets, lengths, np.array([devs[x] for x in seg_l], dtype=np.int64)], axis=1)
        self._read_objects(ends, devs, local, remote)
        self.counters.bytes_read += int(lengths.sum())
        self.counters.bump("ranged_gets", len(seg_l))

    # ------------------------------------------------------------------ admin
    def delete_segment(self, segment_id: int) -> None:
        """See :meth:`Volume.delete_segment`."""
        self._delete_quietly(self.key(segment_id))
        self.counters.segments_deleted += 1

    def segment_exists(self, segment_id: int) -> bool:
        """See :meth:`Volume.segment_exists`: a ``HEAD`` of the segment's object (with
        retries); 404 / ``NoSuchKey`` / ``NotFound`` is ``False``.

        Raises:
            TransferError: the endpoint keeps failing (5xx, connection errors) or refuses.
        """
        return self.segment_size(segment_id) is not None

    def segment_size(self, segment_id: int) -> int | None:
        """See :meth:`Volume.segment_size`: the ``ContentLength`` of a ``HEAD`` of the
        segment's object (with retries); 404 / ``NoSuchKey`` / ``NotFound`` is ``None``.

        Raises:
            TransferError: the endpoint keeps failing (5xx, connection errors) or refuses.
        """
        from botocore.exceptions import ClientError

        key = self.key(segment_id)
        try:
            head = self._retry(lambda: self.client.head_object(Bucket=self.desc.bucket, Key=key))
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchKey", "NotFound"):
                return None
            raise TransferError(f"volume {self.desc.id!r}: HEAD of segment {segment_id} failed: {exc}") from exc
        except Exception as exc:
            raise TransferError(f"volume {self.desc.id!r}: HEAD of segment {segment_id} failed: {exc}") from exc
        return int(head["ContentLength"])

    def list_segments(self) -> list[int]:
        """See :meth:`Volume.list_segments` (paginated listing of this volume's prefix)."""
        pfx = self.key_prefix()

        def listing() -> list[int]:
            ids: list[int] = []
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.desc.bucket, Prefix=pfx):
                for obj in page.get("Contents", []):
                    seg = parse_segment_name(obj["Key"])
                    if seg is not None and obj["Key"] == self.key(seg):
                        ids.append(seg)
            return sorted(ids)

        return self._retry(listing)

    def key_prefix(self) -> str:
        """Common prefix of this volume's object keys (``<prefix>/<encoded id>/``)."""
        return self.key(0).rsplit("/", 1)[0] + "/"

    def lifecycle_rule_id(self) -> str:
        """Id of this volume's lifecycle rule (unique per volume, <= 255 characters)."""
        return f"kvadvisor-{self.key_prefix()}"[:255]

    def configure_lifecycle(self, days: int, abort_multipart_days: int = 1) -> dict[str, Any]:
        """Let S3 expire this volume's segment objects ``days`` days after their creation.

        Other rules of the bucket (other volumes, other owners) are kept: the bucket's
        configuration is read, this volume's rule (:meth:`lifecycle_rule_id`, filtered on
        :meth:`key_prefix`) is replaced or added, and the whole is written back
        (``put_bucket_lifecycle_configuration``, with retries).  Expired segments are gone
        for good: a ``get`` of a block in one raises ``TransferError``; use it for volumes
        that are a cache of blocks that can be recomputed.

        Args:
            days: expiry age in days (int >= 1).
            abort_multipart_days: incomplete multipart uploads are aborted after this many days.

        Returns:
            the rule written.

        Raises:
            InvalidRequestError: ``days`` or ``abort_multipart_days`` is not an int >= 1.
        """
        for name, v in (("days", days), ("abort_multipart_days", abort_multipart_days)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidRequestError(f"volume {self.desc.id!r}: lifecycle {name} must be an int >= 1, got {v!r}")
        from botocore.exceptions import ClientError

        rule: dict[str, Any] = {
            "ID": self.lifecycle_rule_id(),
            "Filter": {"Prefix": self.key_prefix()},
            "Status": "Enabled",
            "Expiration": {"Days": days},
            "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": abort_multipart_days},
        }
        bucket = self.desc.bucket

        def current() -> list[dict[str, Any]]:
            try:
                return list(self.client.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", []))
            except ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) == "NoSuchLifecycleConfiguration":
                    return []
                raise

        rules = [r for r in self._retry(current) if r.get("ID") != rule["ID"]] + [rule]
        self._retry(lambda: self.client.put_bucket_lifecycle_configuration(
            Bucket=bucket, LifecycleConfiguration={"Rules": rules}))
        return rule
