"""Specification of IdealCache: the longest common prefix of a query with any stored sequence, as an infinite
prefix cache would find it, checked against brute force."""

from __future__ import annotations

from array import array

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.replay.ideal import IdealCache, common_prefix_tokens


def tokens(*values: int) -> array:
    return array(TOKEN_TYPECODE, values)


def key(*values: int) -> bytes:
    """The documented key form: big-endian uint32 bytes."""
    return np.array(values, dtype=">u4").tobytes()


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_empty_cache_finds_nothing() -> None:
    assert IdealCache().lookup(tokens(1, 2, 3)) == 0


def test_lookup_of_a_stored_sequence_is_its_length() -> None:
    cache = IdealCache()
    cache.add(tokens(5, 6, 7))

    assert cache.lookup(tokens(5, 6, 7)) == 3


def test_lookup_extending_a_stored_sequence_is_the_stored_length() -> None:
    cache = IdealCache()
    cache.add(tokens(5, 6, 7))

    assert cache.lookup(tokens(5, 6, 7, 8, 9)) == 3


def test_lookup_of_a_prefix_of_a_stored_sequence_is_the_query_length() -> None:
    cache = IdealCache()
    cache.add(tokens(5, 6, 7, 8, 9))

    assert cache.lookup(tokens(5, 6)) == 2


def test_lookup_takes_the_best_of_all_stored_sequences() -> None:
    cache = IdealCache()
    for sequence in ([1, 2, 9], [1, 2, 3, 4, 9], [1, 7], [2, 2, 3, 4, 5]):
        cache.add(tokens(*sequence))

    assert cache.lookup(tokens(1, 2, 3, 4, 5)) == 4


def test_lookup_compares_whole_token_ids_not_bytes() -> None:
    # 257 agrees with 1 in its low byte and with 256 in its high bytes: only whole ids may count.
    cache = IdealCache()
    cache.add(tokens(7, 257, 3))
    cache.add(tokens(7, 256, 3))

    assert cache.lookup(tokens(7, 1, 3)) == 1
    assert cache.lookup(tokens(7, 256, 3, 4)) == 3


def test_num_tokens_counts_each_distinct_sequence_once() -> None:
    cache = IdealCache()
    cache.add(tokens(1, 2, 3))
    cache.add(tokens(1, 2, 3))
    cache.add(tokens(1, 2))

    assert cache.num_tokens == 5


def test_common_prefix_tokens_of_keys() -> None:
    assert common_prefix_tokens(key(1, 2, 3), key(1, 2, 4)) == 2
    assert common_prefix_tokens(key(1, 2), key(1, 2, 4)) == 2
    assert common_prefix_tokens(key(), key(1)) == 0
    assert common_prefix_tokens(key(7, 2**32 - 1), key(7, 2**32 - 1)) == 2
    assert common_prefix_tokens(key(7, 256), key(7, 257)) == 1


# Ids that share some of their four bytes, so a prefix must be counted in whole ids, never in bytes.
VOCAB = [0, 1, 2, 255, 256, 257, 65536, 2**24, 2**32 - 1]
sequences = st.lists(st.sampled_from(VOCAB), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.lists(sequences, min_size=1, max_size=25))
def test_lookup_equals_brute_force_longest_common_prefix(stream: list[list[int]]) -> None:
    cache = IdealCache()
    seen: list[list[int]] = []
    for sequence in stream:
        assert cache.lookup(tokens(*sequence)) == max((lcp(sequence, s) for s in seen), default=0)
        cache.add(tokens(*sequence))
        seen.append(sequence)


@settings(max_examples=100, deadline=None)
@given(st.lists(sequences, min_size=1, max_size=25))
def test_num_tokens_equals_the_tokens_of_distinct_sequences(stream: list[list[int]]) -> None:
    cache = IdealCache()
    for sequence in stream:
        cache.add(tokens(*sequence))

    assert cache.num_tokens == sum(len(s) for s in {tuple(s) for s in stream})
