"""The sweep against separate ``--cache-tokens`` replays at 6 sizes, on the real transcripts and traces in
``../shared/data`` (byte tokenizer, block size 16).

The radix tree evicts as an LRU stack of blocks does (see :mod:`prefixcache.replay.sweep`), so the two agree token
for token but where the request in flight holds blocks it does not keep, at a full pool: measured on the whole files,
OpenAssistant 9 tokens apart at the smallest pool (0.0017 points) and tau-bench 48 tokens at a quarter of the working
set (0.0001 points), every other file and size equal.  Hit rates must agree within ``TOLERANCE_POINTS``, half the
0.01% the replay prints, so the printed rates are equal.
``PREFIXCACHE_SLOW_TESTS=1`` runs MT-Bench, tau-bench and the Mooncake traces whole; by default
their first conversations (lines) only.
"""

from __future__ import annotations

import os

import pytest

from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.replay.replayer import Replayer
from prefixcache.replay.requests import load_requests
from prefixcache.replay.sweep import sweep_lru

SLOW = os.environ.get("PREFIXCACHE_SLOW_TESTS") == "1"
TOLERANCE_POINTS = 0.005
FRACTIONS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)  # of the working set, from the smallest pool that replays the file
FILES = [
    ("oasst_en100_tree_paths.jsonl", None),
    ("mtbench_31models.jsonl", None if SLOW else 800),
    ("tau_bench_airline_gpt4o.jsonl", None if SLOW else 40),
    ("mooncake/synthetic_trace.jsonl", None if SLOW else 800),
    ("mooncake/conversation_trace.jsonl", None if SLOW else 1500),
]


@pytest.mark.parametrize(("name", "limit"), FILES, ids=[n for n, _ in FILES])
def test_the_sweep_matches_separate_replays_at_six_sizes(shared_data, name: str, limit: int | None):
    path = shared_data(name)
    requests, _ = load_requests(path, ByteTokenizer(), limit=limit)
    result = sweep_lru([(r.prompt, r.answer) for r in requests], 16)
    unlimited = Replayer(None, block_size=16).replay(str(path), requests)
    assert result.unlimited_hit_tokens == unlimited.cached_tokens == unlimited.ideal_cached_tokens
    low, high = result.min_blocks, result.working_set_blocks
    for fraction in FRACTIONS:
        blocks = round(low + fraction * (high - low))
        real = Replayer(None, block_size=16, cache_tokens=blocks * 16).replay(str(path), requests)
        gap = 100 * abs(result.hit_tokens(blocks) - real.cached_tokens) / real.prompt_tokens
        assert gap <= TOLERANCE_POINTS, (blocks, result.hit_tokens(blocks), real.cached_tokens)
