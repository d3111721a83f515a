"""Property: a request of exactly the pool's size succeeds when nothing else runs, whatever ran before it.

README, Limits: "A pool sized exactly to its longest request is always enough when nothing else runs."  Earlier
requests leave branches inside blocks (seams, see :mod:`prefixcache.cache.tree`); the last request must still fit.
"""

from __future__ import annotations

from functools import cache

from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.testing import assert_quiescent

BLOCK_SIZE = 4
POOL_TOKENS = 96  # 24 blocks of 4
BASE = [1 + (i * 37) % 199 for i in range(POOL_TOKENS)]


@cache
def tiny_model():
    from prefixcache.models import build_model

    return build_model("tiny")


# One earlier request: a prefix of BASE, a tail of its own, tokens generated after it.
earlier = st.tuples(
    st.integers(1, POOL_TOKENS - 12),  # with its tail and new tokens, at most the pool
    st.lists(st.integers(200, 249), max_size=6),
    st.integers(0, 6),
)


@settings(max_examples=80, deadline=None)
# Two branches leave block 0 after 1 token; the one sharing the parent's copy kept the other's seam from healing
# until eviction took it, so the lock pinned a block the decode needed (found by this test).
@example(history=[(1, [200], 0), (4, [], 0)], prompt_tokens=5, batched=False)
@example(history=[(1, [200], 0), (4, [], 0)], prompt_tokens=5, batched=True)
@given(
    history=st.lists(earlier, min_size=1, max_size=6),
    prompt_tokens=st.integers(1, POOL_TOKENS - 1),
    batched=st.booleans(),
)
def test_a_request_of_exactly_the_pool_succeeds_after_any_history(
    history: list[tuple[int, list[int], int]], prompt_tokens: int, batched: bool
) -> None:
    from prefixcache.engine.batching import BatchEngine

    runner = PrefixCachingRunner(tiny_model(), cache_tokens=POOL_TOKENS, block_size=BLOCK_SIZE)
    for length, tail, new_tokens in history:
        runner.generate(BASE[:length] + tail, SamplingParams(max_new_tokens=new_tokens))
    prompt = BASE[:prompt_tokens]
    sampling = SamplingParams(max_new_tokens=POOL_TOKENS - prompt_tokens)
    if batched:
        engine = BatchEngine(runner)
        handle = engine.submit(prompt, sampling)
        engine.run_until_idle()
        result = handle.result()
    else:
        result = runner.generate(prompt, sampling)
    assert len(result.token_ids) == POOL_TOKENS - prompt_tokens
    runner.cache.check_invariants()
    assert_quiescent(runner.cache)
