"""Specification of ``replay --sweep``: one pass gives the hits of every cache size, equal to a direct simulation of
its block model at each size, and to the radix tree where the tree's eviction is a stack algorithm."""

from __future__ import annotations

import json
from array import array
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.errors import InvalidArgumentError
from prefixcache.replay.sweep import sweep_lru
from prefixcache.replay.sweep_report import knee_blocks, kv_bytes_per_token_from_config, round_sizes, summarize

Pairs = list[tuple[array, array]]


def block_model_hits(pairs: Pairs, block_size: int, capacity: int) -> int:
    """The sweep's block model simulated directly at one capacity: an ordered dict of cached blocks, oldest first,
    trimmed to ``capacity`` after each request (written apart from the sweep, with tuples for block contents)."""
    names: dict[tuple, int] = {}
    content: list[tuple] = []
    kids: dict[int, list[int]] = {}
    cached: OrderedDict[int, None] = OrderedDict()
    stack: dict[int, int] = {}  # every block in the recency stack (any capacity): its last touch
    clock = total = 0
    for prompt, answer in pairs:
        seq = list(prompt) + list(answer)
        limit = len(prompt) - 1
        ids, parent = [], -1
        for j in range(-(-len(seq) // block_size)):
            key = (parent, tuple(seq[j * block_size : (j + 1) * block_size]))
            if key not in names:
                names[key] = len(content)
                content.append(key[1])
                kids.setdefault(parent, []).append(names[key])
            parent = names[key]
            ids.append(parent)
        hittable = limit // block_size
        m = 0
        while m < hittable and ids[m] in cached:
            m += 1
        want = seq[m * block_size : min((m + 1) * block_size, limit)]
        best = 0
        for c in kids.get(ids[m - 1] if m else -1, []):
            if c in cached:
                n = 0
                while n < min(len(want), len(content[c])) and want[n] == content[c][n]:
                    n += 1
                best = max(best, n)
        total += m * block_size + best
        path = list(ids)
        if len(seq) % block_size:  # a partial last block lives in the newest block that extends it
            data, holder = content[ids[-1]], None
            for c in kids.get(ids[-2] if len(ids) > 1 else -1, []):
                if c != ids[-1] and c in stack and content[c][: len(data)] == data and len(content[c]) > len(data):
                    if holder is None or stack[c] > stack[holder]:
                        holder = c
            path[-1] = ids[-1] if holder is None else holder
        for block in reversed(path):
            cached.pop(block, None)
            cached[block] = None
            clock += 1
            stack[block] = clock
        parent = -1
        for block in path:  # shorter partial blocks that a touched block extends merge into it
            for c in kids.get(parent, []):
                shorter = len(content[c]) < len(content[block])
                if c != block and c in stack and shorter and content[block][: len(content[c])] == content[c]:
                    cached.pop(c, None)
                    del stack[c]
            parent = block
        while len(cached) > capacity:
            cached.popitem(last=False)
    return total


def radix_hits(pairs: Pairs, block_size: int, capacity_blocks: int) -> int:
    """The radix tree's hits with a pool of ``capacity_blocks``, admitted as the cache-only replay admits."""
    cache = RadixCache(KVBlockPool(capacity_blocks, block_size))
    total = 0
    for prompt, answer in pairs:
        lease = cache.acquire(prompt, None, num_tokens=len(prompt))
        cache.reserve(lease, len(prompt) + len(answer))
        cache.commit(lease, prompt + answer)
        total += lease.num_cached_tokens
    cache.check_invariants()
    return total


@st.composite
def workloads(draw, aligned: bool = False, shared: bool = True):
    """Round-robin conversations over a 3-token alphabet (so prefixes collide), each turn extending the last;
    ``aligned``: every length a whole number of blocks and no prefix shared across conversations."""
    block_size = draw(st.sampled_from([2, 3, 4]))
    unit = block_size if aligned else 1
    conversations = []
    for c in range(draw(st.integers(1, 4))):
        offset = 0 if shared else 10 * (c + 1)
        token = st.integers(1, 3).map(lambda t, offset=offset: t + offset)
        seq, turns = array("I"), []
        for _ in range(draw(st.integers(1, 4))):
            new = array("I", draw(st.lists(token, min_size=1, max_size=3)) * unit)
            prompt = seq + new
            answer = array("I", draw(st.lists(token, min_size=0 if not aligned else 1, max_size=2)) * unit)
            turns.append((prompt, answer))
            seq = prompt + answer
        conversations.append(turns)
    pairs = [t[i] for i in range(max(map(len, conversations))) for t in conversations if i < len(t)]
    return pairs, block_size


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_sweep_equals_its_block_model_simulated_at_every_size(case):
    pairs, bs = case
    result = sweep_lru(pairs, bs)
    for capacity in range(1, len(result.hits_by_blocks) + 2):
        assert result.hit_tokens(capacity) == block_model_hits(pairs, bs, capacity), capacity


@settings(max_examples=100, deadline=None)
@given(workloads(aligned=True, shared=False))
def test_sweep_equals_the_radix_tree_at_every_size_on_block_aligned_conversations(case):
    pairs, bs = case
    result = sweep_lru(pairs, bs)
    for capacity in range(result.min_blocks, len(result.hits_by_blocks) + 2):
        assert result.hit_tokens(capacity) == radix_hits(pairs, bs, capacity), capacity


def test_unlimited_hits_are_the_ideal_and_a_tight_pool_keeps_only_the_recent_conversation():
    a = array("I", [1] * 8)
    b = array("I", [2] * 8)
    pairs = [(a, array("I", [1] * 4)), (b, array("I", [2] * 4)), (a + array("I", [1] * 4) + a, array("I"))]
    result = sweep_lru(pairs, 4)
    # The third prompt (20 tokens, 5 blocks: the smallest pool) re-reads conversation a's 12 tokens (3 blocks), all
    # kept while b's 3 newer blocks and a's 3 fit (6 blocks); with 5, a's deepest block went first.
    assert result.min_blocks == 5
    assert [result.hit_tokens(c) for c in (5, 6, 7, 100)] == [8, 12, 12, 12]
    assert [radix_hits(pairs, 4, c) for c in (5, 6, 7)] == [8, 12, 12]
    assert result.working_set_blocks == 6
    assert result.prompt_tokens == 36
    assert result.hit_rate(6) == pytest.approx(12 / 36)


def test_a_copied_partial_block_counts_its_rows():
    # The second prompt shares 6 tokens with the first sequence: one whole block of 4 and 2 copied rows.
    pairs = [(array("I", [1, 2, 3, 4, 5, 6, 7]), array("I")), (array("I", [1, 2, 3, 4, 5, 6, 9, 9]), array("I"))]
    result = sweep_lru(pairs, 4)
    assert result.hit_tokens(2) == 6 == radix_hits(pairs, 4, 2)
    assert result.whole_block_hit_tokens(2) == 4


def test_bad_arguments_are_refused():
    with pytest.raises(InvalidArgumentError):
        sweep_lru([], 0)
    with pytest.raises(InvalidArgumentError):
        sweep_lru([], 4).hit_tokens(-1)


def test_round_sizes_are_whole_blocks_between_the_smallest_pool_and_the_working_set():
    assert round_sizes(700, 30_000, 16) == [700, 1008, 2000, 5008, 10000, 20000, 30000]


def test_the_knee_is_the_smallest_pool_within_one_point_of_unlimited():
    a, b = array("I", range(1, 101)), array("I", range(201, 301))
    pairs = [(a, array("I")), (b, array("I")), (a + array("I", [7]), array("I")), (b + array("I", [7]), array("I"))]
    result = sweep_lru(pairs, 10)
    # Both re-reads hit 100 tokens with 21 blocks (a, b and the first re-read's new block); each block less costs
    # the second re-read b's deepest block, and from 20 down the first re-read a's too (2 blocks a step).
    assert [result.hit_tokens(c) for c in (21, 20, 19, 11)] == [200, 190, 170, 10]
    assert knee_blocks(result) == 21  # unlimited 200 of 402 prompt tokens; 190 is 2.5 points below
    summary = summarize("s", result, pairs)
    assert summary.knee_tokens == 210
    assert [p.capacity_tokens for p in summary.points] == [110, 200, 210]
    # Belady keeps a whole from 11 blocks on (it bypasses b, used later than a); whole blocks only.
    assert [round(p.belady_hit_rate * 402) for p in summary.points] == [110, 200, 200]


def test_kv_bytes_per_token_come_from_the_model_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896})
    )
    assert kv_bytes_per_token_from_config(config, "bf16") == 2 * 24 * 2 * 64 * 2
    assert kv_bytes_per_token_from_config(config, "fp8", layers=4) == 2 * 4 * 2 * 64
    with pytest.raises(InvalidArgumentError, match="kv-dtype"):
        kv_bytes_per_token_from_config(config, "int3")
    config.write_text("{}")
    with pytest.raises(InvalidArgumentError, match="KV shape"):
        kv_bytes_per_token_from_config(config)
