"""Speculative decoding at its edges, found by trying to break it: a request cancelled from its own callback in the
step that verifies its draft emits nothing after the cancel, as without speculation."""

from __future__ import annotations

from concurrent.futures import CancelledError

import pytest
from test_speculation import BLOCK, Adversary, _ids, full_answer

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent


@pytest.mark.parametrize("cancel_at", [2, 4])
def test_a_request_cancelled_by_its_callback_mid_draft_emits_nothing_after_the_cancel(
    tiny: LlamaModel, cancel_at: int
) -> None:
    prompt = _ids(9, seed=1)
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=BLOCK)
    drafts = Adversary({tuple(prompt): full_answer(tiny, prompt)}, 0, ["right"])  # every draft accepted whole
    engine = BatchEngine(runner, speculate="tree", drafts=drafts)
    seen: list[int] = []
    handles = []

    def on_token(token: int) -> bool:
        seen.append(token)
        if len(seen) == cancel_at:
            handles[0].cancel()
        return False

    handles.append(engine.submit(prompt, SamplingParams(max_new_tokens=14), on_token=on_token))
    engine.run_until_idle()
    with pytest.raises(CancelledError):
        handles[0].result()
    assert drafts.accepted > 0  # the cancel came inside a verified draft
    assert seen == full_answer(tiny, prompt)[:cancel_at]
    assert engine.core.cancelled_requests == 1
    assert_quiescent(runner.cache)
