"""Which tier serves each leading block of a router lookup (api.hit_rates.served_per_tier):
the hit rates per tier count what a worker would read from each tier, so a tier that only
extends the prefix (S3 holding its cold tail) is counted, and a tier is never counted for a
block a faster one serves."""

from __future__ import annotations

from api.hit_rates import served_per_tier


def tier_of(loc: str) -> tuple[str, str | None]:
    src, sep, tier = loc.rpartition("/")
    if sep and tier in ("g1", "g2"):
        return tier.upper(), src
    return ("G4" if loc == "s3" else "G3"), None


def test_the_cold_tail_on_s3_counts_for_g4_and_each_block_goes_to_its_fastest_tier() -> None:
    rows = [{"w0/g1", "slow"}, {"w0/g1", "slow"}, {"w0/g2", "slow"}, {"slow"}, {"s3"}, {"s3"}]
    assert served_per_tier(rows, tier_of) == ("w0", {"G1": 2, "G2": 1, "G3": 1, "G4": 2})


def test_another_workers_g1_is_not_usable_and_the_best_placed_worker_wins() -> None:
    # w1 holds the first two blocks in G1, w0 holds three in G2: w0 reaches further
    rows = [{"w1/g1", "w0/g2"}, {"w1/g1", "w0/g2"}, {"w0/g2"}, {"s3"}]
    assert served_per_tier(rows, tier_of) == ("w0", {"G2": 3, "G4": 1})
    # only w1 holds block 0: w0 and the volumes alone serve nothing; w1 reads block 1 from slow
    assert served_per_tier([{"w1/g1"}, {"slow", "w0/g2"}], tier_of) == ("w1", {"G1": 1, "G3": 1})


def test_only_volumes_and_nothing_at_all() -> None:
    assert served_per_tier([{"fast", "slow"}, {"s3"}], tier_of) == (None, {"G3": 1, "G4": 1})
    assert served_per_tier([], tier_of) == (None, {})
