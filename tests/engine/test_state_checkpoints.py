"""Specification of where a recurrent model's engine keeps states (prefixcache.cache.marks): where requests part ways
inside a cached sequence — many conversations behind one system prompt, an edited message — the first to part there
marks the position and keeps a state as its prefill passes it, so from the next request on the whole shared prefix
resumes, as it does for an attention model; greedy output stays that of the model's own ``generate``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")

from prefixcache.engine.runner import PrefixCachingRunner, SamplingParams  # noqa: E402
from prefixcache.models.hf import HFCausalLM  # noqa: E402
from prefixcache.models.hf_tiny import tiny_random_model  # noqa: E402
from prefixcache.testing import assert_quiescent  # noqa: E402

BLOCK_SIZE = 16
NEW_TOKENS = 3


_MODELS: dict[str, HFCausalLM] = {}


def _model(model_type: str) -> HFCausalLM:
    if model_type not in _MODELS:
        _MODELS[model_type] = tiny_random_model(model_type, max_positions=2048)
    return _MODELS[model_type]


@pytest.fixture(scope="module")
def qwen3_next() -> HFCausalLM:
    return _model("qwen3_next")


def _tokens(seed: int, length: int) -> list[int]:
    return torch.randint(1, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(model: HFCausalLM, prompt: list[int]) -> list[int]:
    out = model.model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


def _conversations(runner: PrefixCachingRunner, system: list[int], count: int) -> tuple[list[int], list[list[int]]]:
    """``count`` first turns behind ``system``, one after another: the cached tokens and the answer of each."""
    cached, answers = [], []
    for i in range(count):
        result = runner.generate(system + _tokens(100 + i, 20), SamplingParams(max_new_tokens=NEW_TOKENS))
        cached.append(result.usage.cached_tokens)
        answers.append(list(result.token_ids))
    return cached, answers


@pytest.mark.parametrize("model_type", ["mamba2", "qwen3_next", "nemotron_h"])
@pytest.mark.parametrize(
    ("system_tokens", "second"),
    [(200, 0), (600, 512)],  # the second conversation finds only the last 256-token state inside the prompt
)
def test_from_the_third_conversation_on_the_whole_system_prompt_resumes(model_type, system_tokens, second):
    model = _model(model_type)
    runner = PrefixCachingRunner(model, cache_tokens=4096, block_size=BLOCK_SIZE)
    system = _tokens(1, system_tokens)  # 200 and 600: neither ends on a block boundary (16 tokens)
    cached, answers = _conversations(runner, system, 8)
    assert cached == [0, second] + [system_tokens] * 6  # as an attention model from the second on
    for i in (1, 2, 7):
        assert answers[i] == _generate(model, system + _tokens(100 + i, 20))
    stats = runner.cache.stats()
    assert stats.num_branch_marks == 1
    assert system_tokens in runner.cache.state_positions(system, runner.namespace_key(None))
    assert_quiescent(runner.cache)


def test_an_edited_message_resumes_at_the_edit_from_its_second_repetition_on(qwen3_next):
    runner = PrefixCachingRunner(qwen3_next, cache_tokens=4096, block_size=BLOCK_SIZE)
    # A 4-turn chat: each prompt is the previous prompt, its answer and a new 20-token user message.
    prompt, prompts, answers = _tokens(3, 30), [], []
    for turn in range(4):
        if turn:
            prompt = prompts[-1] + answers[-1] + _tokens(10 + turn, 20)
        prompts.append(prompt)
        answers.append(list(runner.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS)).token_ids))
    # The user edits the second message after its 12th token, three times over.
    branch = len(prompts[0]) + NEW_TOKENS + 12
    before = runner.cache.state_positions(prompts[1], runner.namespace_key(None))
    assert branch not in before and max(p for p in before if p < branch) == len(prompts[0]) + NEW_TOKENS - 1
    cached = []
    for edit in range(3):
        edited = prompts[1][:branch] + _tokens(50 + edit, 8)
        result = runner.generate(edited, SamplingParams(max_new_tokens=NEW_TOKENS))
        cached.append(result.usage.cached_tokens)
        assert list(result.token_ids) == _generate(qwen3_next, edited)
    # The first edit resumes where the first answer ended, marks the edit and keeps a state there as it passes.
    assert cached == [len(prompts[0]) + NEW_TOKENS - 1, branch, branch]
    assert_quiescent(runner.cache)


def test_a_marked_position_inside_a_long_prompt_is_kept_by_whoever_prefills_through_it_next(qwen3_next):
    runner = PrefixCachingRunner(qwen3_next, cache_tokens=4096, block_size=BLOCK_SIZE, state_interval_blocks=0)
    shared = _tokens(4, 70)
    runner.generate(shared + _tokens(5, 30), SamplingParams(max_new_tokens=0))
    # Parts at 70: marked, though nothing is computed.
    lease = runner.cache.acquire(shared + _tokens(6, 5), runner.namespace_key(None))
    assert (lease.num_cached_tokens, lease.state_points) == (0, (70,))
    runner.cache.release(lease)
    assert 70 not in runner.cache.state_positions(shared, runner.namespace_key(None))
    # The next request through 70 (it parts later, at 85) keeps the state there and marks 85.
    longer = shared + _tokens(5, 30)[:15] + _tokens(7, 5)
    assert runner.generate(longer, SamplingParams(max_new_tokens=0)).usage.cached_tokens == 0
    assert 70 in runner.cache.state_positions(shared, runner.namespace_key(None))
    result = runner.generate(shared + _tokens(8, 5), SamplingParams(max_new_tokens=NEW_TOKENS))
    assert result.usage.cached_tokens == 70
    assert list(result.token_ids) == _generate(qwen3_next, shared + _tokens(8, 5))
    assert_quiescent(runner.cache)


# ---- snapshots -----------------------------------------------------------------------------------------------------


def test_a_restored_hybrid_cache_resumes_its_first_repeated_prompt(qwen3_next, tmp_path):
    pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")
    system = _tokens(9, 90)
    first = PrefixCachingRunner(qwen3_next, cache_tokens=2048, block_size=BLOCK_SIZE)
    _conversations(first, system, 2)  # states at the ends of both, and at 90, where the second parted
    saved = first.save_snapshot(tmp_path / "snap")
    assert saved.num_states == first.cache.stats().num_states and saved.state_bytes > 0
    restarted = PrefixCachingRunner(qwen3_next, cache_tokens=2048, block_size=BLOCK_SIZE)
    loaded = restarted.load_snapshot(tmp_path / "snap")
    assert (loaded.num_states, loaded.state_bytes) == (saved.num_states, saved.state_bytes)
    repeated = system + _tokens(100, 20)
    result = restarted.generate(repeated, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert result.usage.cached_tokens == len(repeated) - 1
    assert list(result.token_ids) == _generate(qwen3_next, repeated)
    third = restarted.generate(system + _tokens(102, 20), SamplingParams(max_new_tokens=NEW_TOKENS))
    assert third.usage.cached_tokens == len(system)
    assert_quiescent(restarted.cache)


def test_a_saved_state_of_another_shape_is_refused(qwen3_next):
    from prefixcache.errors import SnapshotMismatchError
    from prefixcache.models.base import LiveKV

    state = qwen3_next.take_state(_one_token(qwen3_next, LiveKV()))
    meta, tensors = state.snapshot_parts()
    assert torch.equal(qwen3_next.load_state(1, meta, tensors).layers[0][1][0], state.layers[0][1][0])
    with pytest.raises(SnapshotMismatchError, match="layers"):
        qwen3_next.load_state(1, {"5": [1, 1]}, {})
    first = next(iter(tensors))
    with pytest.raises(SnapshotMismatchError):
        qwen3_next.load_state(1, meta, {**tensors, first: tensors[first][..., :1]})
    # Of the right size in bytes, but flattened, or of a wider dtype with half the values: the first request resuming
    # it would fail inside the model's forward.
    flat = tensors[first].reshape(-1)
    with pytest.raises(SnapshotMismatchError, match=r"float32 \[\d+\]; the model's is"):
        qwen3_next.load_state(1, meta, {**tensors, first: flat})
    with pytest.raises(SnapshotMismatchError, match="float64"):
        qwen3_next.load_state(1, meta, {**tensors, first: flat[: flat.numel() // 2].double()})


def _one_token(model: HFCausalLM, live):
    from prefixcache.models.hf_state import _scratch_pool

    kv, table = _scratch_pool(model)
    model.forward_cached(torch.ones(1, dtype=torch.long), 0, kv, table, live=live)
    return live
