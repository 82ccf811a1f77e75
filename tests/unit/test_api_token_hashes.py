"""Token-id block hashes match Dynamo's indexer (values from ai-dynamo-runtime 1.6.1's
``compute_block_hash_for_seq(list(range(100, 164)), 16)``), and the chain separates prefixes."""

from __future__ import annotations

import pytest

from api.token_hashes import TokenIdError, chain_hashes, local_block_hashes

DYNAMO_1_6_1 = [10823191264391160519, 1219978239041041138, 11579058346470406089, 15355247268704632839]


def test_local_hashes_equal_dynamos() -> None:
    assert local_block_hashes(list(range(100, 164)), 16) == DYNAMO_1_6_1
    assert local_block_hashes(list(range(100, 170)), 16) == DYNAMO_1_6_1  # partial tail ignored
    assert local_block_hashes(list(range(100, 115)), 16) == []


def test_lora_and_position_change_the_keys() -> None:
    t = list(range(100, 164))
    assert local_block_hashes(t, 16, "adapter-a") != DYNAMO_1_6_1
    assert local_block_hashes(t, 16, "adapter-a") != local_block_hashes(t, 16, "adapter-b")
    # the same block after another prefix gets another chain hash
    a = chain_hashes(local_block_hashes(t[:32], 16))
    b = chain_hashes(local_block_hashes(t[16:32] + t[16:32], 16))
    assert a[0] != b[0] and a[1] != b[1] and b[0] != b[1]
    assert chain_hashes([5]) == [5]


@pytest.mark.parametrize("bad", [[1.5] * 16, [-1] * 16, [2**32] * 16, [True] * 16])
def test_bad_tokens_are_refused(bad: list) -> None:  # type: ignore[type-arg]
    with pytest.raises(TokenIdError):
        local_block_hashes(bad, 16)
    with pytest.raises(ValueError):
        local_block_hashes([1], 0)
