"""Token conversion: every accepted form gives the same ``array('I')``, and bad ids are refused whatever the length
(short sequences and long ones take different checks)."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import pytest
import torch

from prefixcache.cache.tokens import BOOL_SCAN_TOKENS, MAX_TOKEN_ID, as_token_array
from prefixcache.errors import InvalidTokensError

LONG = BOOL_SCAN_TOKENS * 3
IDS = [(7 * i) % 50_000 for i in range(LONG)]  # holds 0 and ids far from it

SAME_IDS = {
    "list": IDS,
    "tuple": tuple(IDS),
    "array('q')": array("q", IDS),
    "array('H')": array("H", IDS),
    "numpy int64": np.array(IDS, dtype=np.int64),
    "numpy uint64": np.array(IDS, dtype=np.uint64),
    "numpy big-endian uint32": np.array(IDS, dtype=">u4"),
    "numpy strided": np.repeat(np.array(IDS, dtype=np.int32), 2)[::2],
    "torch int64": torch.tensor(IDS, dtype=torch.int64),
    "torch strided": torch.tensor(IDS, dtype=torch.int64).repeat_interleave(2)[::2],
}


@pytest.mark.parametrize("tokens", SAME_IDS.values(), ids=SAME_IDS.keys())
def test_every_form_of_a_long_sequence_converts_to_the_same_ids(tokens: Any) -> None:
    out = as_token_array(tokens)

    assert out.typecode == "I"
    assert out.tolist() == IDS


def test_the_largest_token_id_is_accepted_from_every_numeric_form() -> None:
    for tokens in ([5] * LONG + [MAX_TOKEN_ID], np.array([5] * LONG + [MAX_TOKEN_ID], dtype=np.uint64)):
        assert as_token_array(tokens)[-1] == MAX_TOKEN_ID


def test_ids_zero_and_one_in_a_long_list_are_tokens_not_bools() -> None:
    tokens = [0, 1] * LONG

    assert as_token_array(tokens).tolist() == tokens


BOOLS = {
    "short, at the end": ([3] * (BOOL_SCAN_TOKENS - 2) + [True], BOOL_SCAN_TOKENS - 2),
    "long, at the end": ([3] * LONG + [False], LONG),
    "long, among zeros and ones": ([0, 1] * LONG + [True, 0], 2 * LONG),
    "long, all bools": ([True] * LONG, 0),
    "long tuple": (tuple([9] * LONG + [True]), LONG),
}


@pytest.mark.parametrize(("tokens", "index"), BOOLS.values(), ids=BOOLS.keys())
def test_a_bool_among_token_ids_is_refused_naming_its_index(tokens: Any, index: int) -> None:
    with pytest.raises(InvalidTokensError, match=f"index {index} is (True|False) of type bool"):
        as_token_array(tokens)


OUT_OF_RANGE = {
    "numpy negative": (np.array([4] * LONG + [-3], dtype=np.int64), f"index {LONG} is -3"),
    "numpy too large": (np.array([4] * LONG + [MAX_TOKEN_ID + 1], dtype=np.uint64), f"index {LONG} is 4294967296"),
    "array('q') negative": (array("q", [4, -1]), "index 1 is -1"),
    "torch negative": (torch.tensor([4] * LONG + [-2]), f"index {LONG} is -2"),
    "long list negative": ([4] * LONG + [-5], f"index {LONG} is -5"),
}


@pytest.mark.parametrize(("tokens", "message"), OUT_OF_RANGE.values(), ids=OUT_OF_RANGE.keys())
def test_an_id_out_of_range_is_refused_naming_the_first_one(tokens: Any, message: str) -> None:
    with pytest.raises(InvalidTokensError, match=message):
        as_token_array(tokens)


def test_empty_integer_arrays_convert_only_when_allowed() -> None:
    for tokens in (array("q"), np.zeros(0, dtype=np.int64), torch.zeros(0, dtype=torch.int32)):
        assert as_token_array(tokens, allow_empty=True).tolist() == []
        with pytest.raises(InvalidTokensError, match="must not be empty"):
            as_token_array(tokens)


def test_an_array_of_the_stored_typecode_is_returned_as_is() -> None:
    tokens = array("I", IDS)

    assert as_token_array(tokens) is tokens


def test_a_sparse_tensor_is_refused_as_token_ids_and_the_cache_is_untouched() -> None:

    from prefixcache.cache.pool import KVBlockPool
    from prefixcache.cache.radix_cache import RadixCache
    from prefixcache.testing import assert_quiescent

    cache = RadixCache(KVBlockPool(8, 4))
    sparse = torch.tensor([1, 2, 3]).to_sparse()
    with pytest.raises(InvalidTokensError, match="dense tensor"):
        cache.acquire(sparse)
    lease = cache.acquire([1, 2, 3], num_tokens=4)
    with pytest.raises(InvalidTokensError, match="dense tensor"):
        cache.commit(lease, sparse)
    cache.release(lease)
    assert_quiescent(cache)
