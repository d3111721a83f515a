"""Property tests of PrefixCachingRunner over drawn conversations and block sizes 1 to 16: the hit is exactly the
longest cached prefix, and cached serving equals uncached serving."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.models import LlamaModel
from prefixcache.testing import greedy_reference

TOL = 1e-4
MAX_NEW = 3


def ids(n: int, seed: int) -> list[int]:
    """``n`` token ids a ByteTokenizer could produce (0..258), fixed by ``seed``."""
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.integers(1, 16),
    turns=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9), st.integers(0, 3)), min_size=2, max_size=5),
)
def test_any_conversation_is_served_exactly_at_any_block_size(tiny: LlamaModel, block_size: int, turns) -> None:
    """Each turn keeps a cut of an earlier turn's prompt + answer and adds new tokens.  With a pool that never
    evicts, the hit is the longest common prefix with what was cached (short of the last prompt token), the
    partially matched block's rows are copied (or the block extended in place), and logits and tokens equal an
    uncached run."""
    runner = PrefixCachingRunner(tiny, cache_tokens=512, block_size=block_size)
    history: list[list[int]] = [[]]
    for i, (cut, new, earlier) in enumerate(turns):
        base = history[-1 - min(earlier, len(history) - 1)]
        prompt = base[:cut] + ids(new, seed=1000 + i)
        expected_hit = min(max(common_prefix(prompt, seq) for seq in history), len(prompt) - 1)

        result = runner.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW), return_logits=True)

        tokens, logits = greedy_reference(tiny, prompt, MAX_NEW)
        usage = result.usage
        # Rows of a partial block are copied unless the hit is all of a cached sequence nothing extends: its block
        # is then written in place.
        hit = prompt[:expected_hit]
        in_place = hit in history and not any(len(seq) > expected_hit and seq[:expected_hit] == hit for seq in history)
        assert (usage.cached_tokens, usage.copied_tokens) == (
            expected_hit,
            0 if in_place else expected_hit % block_size,
        )
        assert float((result.prompt_logits - logits[expected_hit:]).abs().max()) < TOL
        assert list(result.token_ids) == tokens
        history.append(prompt + tokens[:-1])  # the last token is sampled, never fed back, so never cached
    runner.cache.check_invariants()
    assert runner.cache.stats().evictions == 0
