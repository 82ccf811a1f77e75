"""Token ids are validated before hashing: nothing aliases silently (a float 1.9 is not 1)."""

from __future__ import annotations

import numpy as np
import pytest

from kvbm_runtime import TokenIdError, sequence_hashes


@pytest.mark.parametrize(
    "tokens",
    [
        [1.9, 2.1, 3.5, 4.99],  # floats would truncate to 1, 2, 3, 4
        np.array([True, False, True, False]),
        np.zeros((2, 4), dtype=np.int64),  # 2-D: would silently give 0 blocks
        ["1", "2", "3", "4"],
        [-1, 2, 3, 4],
        [2**32, 1, 2, 3],
    ],
    ids=["floats", "bools", "2-D", "strings", "negative", "above-u32"],
)
def test_bad_token_ids_raise_the_runtime_error(tokens: object) -> None:
    with pytest.raises(TokenIdError):
        sequence_hashes(tokens, 2, seed=0)  # type: ignore[arg-type]


def test_int_dtypes_hash_alike_and_empty_is_no_block() -> None:
    want = sequence_hashes([1, 2, 3, 4, 5], 2, seed=7)
    assert len(want) == 2
    for dt in (np.int32, np.int64, np.uint32, np.uint64, np.uint16):
        assert sequence_hashes(np.arange(1, 6, dtype=dt), 2, seed=7) == want
    assert sequence_hashes([], 2, seed=7) == []
