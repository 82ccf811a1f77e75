"""The fold's one-pass quota check (``PrefixIndex.apply_payload_within``) decides every batch
exactly as the full check (``QuotaGuard.admit``): a differential test over random logs,
with limits small enough that every quota is hit."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advisor.cluster.partition_fold import PartitionFold
from advisor.index.prefix_index import PrefixIndex
from advisor.ingest.quotas import QuotaLimits
from event_plane.codec import encode_batch
from event_plane.schema import EventBatch, cleared, remove, store

LOCATIONS = ("g1", "g2", "vol-a", "vol-b", "vol-c", "bad/name")

_event = st.tuples(
    st.sampled_from(("store", "store", "store", "remove", "cleared")),
    st.integers(1, 60),  # sequence hash
    st.sampled_from(LOCATIONS),
    st.sampled_from((None, None, None, {"k": "v"}, {"k": "x" * 300})),  # metadata: the full check's path
)
_batch = st.tuples(st.sampled_from(("w0", "w1", "w2", "w3")), st.integers(1, 3),  # epoch (restarts)
                   st.lists(_event, min_size=0, max_size=12))


def _payloads(log: list) -> list[bytes]:  # noqa: ANN001
    seqs: dict[tuple[str, int], int] = {}
    out = []
    for source, epoch, events in log:
        seq = seqs.get((source, epoch), 0)
        seqs[(source, epoch)] = seq + 1
        evs = []
        for kind, h, loc, meta in events:
            parent = h - 1 if h > 1 else None
            if kind == "store":
                evs.append(store(h, 1, parent, 32, loc, meta))
            elif kind == "remove":
                evs.append(remove(h, 1, parent, 32, loc))
            else:
                evs.append(cleared(loc))
        out.append(encode_batch(EventBatch(1, source, epoch, seq, 1_000 + len(out), evs)))
    return out


class _FullCheckOnly(PartitionFold):
    """The fold as it was before the one-pass check: every batch through ``QuotaGuard.admit``."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        if self._plain:
            self._plain = (-1, *self._plain[1:])  # no batch has <= -1 events: never plainly within


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(log=st.lists(_batch, min_size=1, max_size=60),
       max_sources=st.integers(1, 4), max_locations=st.integers(1, 3), max_batch_events=st.integers(1, 12),
       max_source_blocks=st.one_of(st.integers(1, 15), st.just(1000)), max_blocks=st.integers(1, 25),
       max_event_metadata_bytes=st.sampled_from((64, 4096)))
def test_the_one_pass_check_decides_as_the_full_check(log, max_sources, max_locations, max_batch_events,  # noqa: ANN001
                                                       max_source_blocks, max_blocks, max_event_metadata_bytes) -> None:
    limits = QuotaLimits(max_sources=max_sources, max_locations=max_locations, max_batch_events=max_batch_events,
                         max_source_blocks=max_source_blocks, max_blocks=max_blocks,
                         max_event_metadata_bytes=max_event_metadata_bytes)
    fast, full = PartitionFold(PrefixIndex(), limits), _FullCheckOnly(PrefixIndex(), limits)
    for p in _payloads(log):
        assert fast.apply(p) == full.apply(p)
    assert fast.index.dump() == full.index.dump()
    assert fast.quotas.as_dict() == full.quotas.as_dict()
    assert fast.quotas.counters.epochs_forgotten == full.quotas.counters.epochs_forgotten
    assert fast.duplicates == full.duplicates


def test_plain_batches_take_the_one_pass_and_the_rest_the_full_check() -> None:
    """The one pass takes exactly the batches it can decide alone (``admitted`` is left
    ``None`` for those: nothing was decoded), and hands the others to the full check."""
    limits = QuotaLimits(max_sources=2, max_source_blocks=3)
    fold = PartitionFold(PrefixIndex(), limits)

    def apply(source: str, seq: int, *events) -> bool:  # noqa: ANN002
        return fold.apply(encode_batch(EventBatch(1, source, 7, seq, 1_000 + seq, list(events))))

    assert apply("w0", 0, store(1, 1, None, 32, "g1"), store(2, 1, 1, 32, "g1")) and fold.admitted is None
    assert apply("w0", 1, store(3, 1, 2, 32, "vol")) and fold.admitted is not None  # a new volume name
    assert apply("w0", 2, store(4, 1, 3, 32, "vol")) and fold.admitted is None  # now a known one
    # 2 held + 2 > 3: not plainly within, so the full check refuses the second Store alone
    assert apply("w0", 3, store(5, 1, 4, 32, "g1"), store(6, 1, 5, 32, "g2")) and fold.admitted is not None
    assert fold.index.block(5) is not None and fold.index.block(6) is None
    assert fold.quotas.as_dict()["quota_refused_events_source_blocks"] == 1
    assert apply("w1", 0, store(9, 9, None, 32, "g1")) and fold.admitted is None  # a second source: room
    assert not apply("w2", 0, store(10, 10, None, 32, "g1"))  # a third: refused whole by the full check
    assert fold.quotas.as_dict()["quota_refused_batches_sources"] == 1
    assert apply("w1", 1, store(11, 9, 9, 32, "g1", {"k": "v"})) and fold.admitted is not None  # metadata


def test_the_block_quotas_bound_the_one_pass_exactly() -> None:
    """At the limit the one pass applies; one block over, the full check refuses that Store."""
    for limits, over in ((QuotaLimits(max_blocks=3), "blocks"), (QuotaLimits(max_source_blocks=3), "source_blocks")):
        fold = PartitionFold(PrefixIndex(), limits)
        batches = [[store(1, 1, None, 32, "g1"), store(2, 1, 1, 32, "g1")], [store(3, 1, 2, 32, "g2")],
                   [store(4, 1, 3, 32, "g1")]]
        got = [fold.apply(encode_batch(EventBatch(1, "w", 1, seq, 1_000 + seq, evs))) for seq, evs in enumerate(batches)]
        assert got == [True, True, True] and len(fold.index) == 3 and fold.index.block(4) is None
        assert fold.quotas.as_dict()[f"quota_refused_events_{over}"] == 1
