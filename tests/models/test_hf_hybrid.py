"""Hybrid and recurrent Hugging Face models (Qwen3-Next, Nemotron-H, Granite-4.0-H, MiniMax, Mamba-2): the state
layout read from the model, state snapshots, and resuming a prefix from a snapshot plus the pooled K/V of its
attention layers, against the model's own forward.  Tiny random configs; nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from prefixcache.cache.pool import KVBlockPool  # noqa: E402
from prefixcache.engine.batching import BatchEngine  # noqa: E402
from prefixcache.engine.runner import PrefixCachingRunner, SamplingParams  # noqa: E402
from prefixcache.errors import InvalidArgumentError, UnsupportedModelError  # noqa: E402
from prefixcache.models.base import LiveKV  # noqa: E402
from prefixcache.models.hf import HFCausalLM  # noqa: E402
from prefixcache.models.hf_tiny import HYBRID_MODEL_TYPES, tiny_hf_config  # noqa: E402
from prefixcache.testing import assert_quiescent  # noqa: E402

BLOCK_SIZE = 16
# A recurrent layer's chunked scan rounds differently when its forward is split (the prefill stops where states are
# kept): against the unsplit uncached forward these tiny models (logits up to ~8) differ by up to ~5e-4.  Against the
# model's own forward split at the same place they are equal (test_resuming_from_a_snapshot_...).
SPLIT_ATOL = 2e-3
SPLIT, LENGTH = 41, 70  # a prefix ending inside a block, and the whole sequence


@pytest.fixture(scope="module", params=HYBRID_MODEL_TYPES)
def hybrid(request) -> HFCausalLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return HFCausalLM(transformers.AutoModelForCausalLM.from_config(tiny_hf_config(request.param)).eval())


def _pool(model: HFCausalLM) -> KVBlockPool:
    return KVBlockPool(
        8, BLOCK_SIZE, num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim
    )


def _tokens() -> torch.Tensor:
    return torch.randint(1, 300, (LENGTH,), generator=torch.Generator().manual_seed(3))


def _own_split_forward(model: HFCausalLM, ids: torch.Tensor, split: int) -> torch.Tensor:
    """The model's own forward of ``ids[:split]`` into a cache, then of ``ids[split:]`` on it: logits of the second."""
    cache = model.transfer.new_cache(len(ids))
    with torch.inference_mode():
        for lo, hi in ((0, split), (split, len(ids))):
            inputs = model._inputs(input_ids=ids[None, lo:hi], position_ids=torch.arange(lo, hi)[None])
            out = model.model(**inputs, use_cache=True, **{model.cache_kwarg: cache})
    return out.logits[0].float()


def test_the_layout_names_the_state_layers_and_the_pool_holds_only_the_attention_layers(hybrid):
    layout = hybrid.layout
    assert hybrid.recurrent and layout.recurrent
    kinds = {type(layer).__name__ for layer in hybrid.transfer.new_cache(1).layers}
    assert layout.state_layers or layout.minimax_layers
    assert hybrid.num_layers == max(1, len(layout.kv_layers))
    assert set(layout.kv_layers).isdisjoint(layout.state_layers)
    assert "GrowingLayer" in kinds or not layout.kv_layers
    assert hybrid.state_bytes > 0


def test_qwen3_next_state_bytes_follow_its_config():
    config = tiny_hf_config("qwen3_next")
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config).eval())
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    conv = (2 * key_dim + value_dim) * config.linear_conv_kernel_dim
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    linear_layers = config.layer_types.count("linear_attention")
    assert model.state_bytes == linear_layers * (conv + recurrent) * 4  # float32


def _prefix_state(model: HFCausalLM):
    """``(ids, pool, table, state)``: the first SPLIT tokens prefilled into a fresh pool, their state taken."""
    ids, pool, table = _tokens(), _pool(model), torch.arange(8)
    live = LiveKV()
    model.forward_cached(ids[:SPLIT], 0, pool.kv, table, live=live)
    return ids, pool, table, model.take_state(live)


def test_resuming_from_a_snapshot_equals_the_models_own_forward_split_there(hybrid):
    ids, pool, table, state = _prefix_state(hybrid)
    assert state.position == SPLIT and state.nbytes == hybrid.state_bytes
    resumed = LiveKV()
    resumed.start_state = state
    logits = hybrid.forward_cached(ids[SPLIT:], SPLIT, pool.kv, table, return_logits=True, live=resumed)
    assert torch.equal(logits, _own_split_forward(hybrid, ids, SPLIT))
    # Against the uncached forward the model's chunked scans differ from themselves by a little when split elsewhere.
    reference = hybrid.forward_reference(ids, return_logits=True, logits_from=SPLIT)
    torch.testing.assert_close(logits, reference, atol=SPLIT_ATOL, rtol=0)


def test_a_snapshot_is_not_changed_by_the_requests_that_resume_from_it(hybrid):
    ids, pool, table, state = _prefix_state(hybrid)
    outputs = []
    for _ in range(2):
        resumed = LiveKV()
        resumed.start_state = state
        steps = [hybrid.forward_cached(ids[SPLIT : SPLIT + 1], SPLIT, pool.kv, table, live=resumed)]
        steps.append(hybrid.forward_cached(ids[SPLIT + 1 : SPLIT + 2], SPLIT + 1, pool.kv, table, live=resumed))
        outputs.append(torch.cat(steps))
    assert torch.equal(outputs[0], outputs[1])


def test_resuming_without_the_state_of_that_position_is_refused_and_writes_nothing(hybrid):
    ids, pool, table, state = _prefix_state(hybrid)
    before = pool.kv.clone()
    with pytest.raises(InvalidArgumentError, match="state snapshot"):
        hybrid.forward_cached(ids[SPLIT:], SPLIT, pool.kv, table, live=LiveKV())
    wrong = LiveKV()
    wrong.start_state = state
    with pytest.raises(InvalidArgumentError, match=f"one at {SPLIT}"):
        hybrid.forward_cached(ids[SPLIT + 1 :], SPLIT + 1, pool.kv, table, live=wrong)
    with pytest.raises(InvalidArgumentError, match="state snapshot"):
        hybrid.forward_cached(ids[SPLIT:], SPLIT, pool.kv, table)
    assert torch.equal(pool.kv, before)


def test_take_state_needs_a_recurrent_model_and_a_live_cache(hybrid):
    with pytest.raises(InvalidArgumentError, match="forward has run"):
        hybrid.take_state(LiveKV())
    plain = HFCausalLM(transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama")).eval())
    assert not plain.recurrent and plain.state_bytes == 0
    with pytest.raises(InvalidArgumentError, match="no recurrent layers"):
        plain.take_state(LiveKV())


# ---- through the runner and the batching engine ------------------------------------------------------------------

PROMPT_LENGTH, NEW_TOKENS = 50, 6


def _hf_generate(model: HFCausalLM, prompt: list[int], new_tokens: int) -> list[int]:
    out = model.model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


def _prompt(seed: int, length: int = PROMPT_LENGTH) -> list[int]:
    return torch.randint(1, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_chats_next_turn_resumes_at_the_last_answers_state_and_equals_generate(hybrid):
    runner = PrefixCachingRunner(hybrid, cache_tokens=1024, block_size=BLOCK_SIZE)
    assert runner.cache.max_state_bytes is not None
    first_prompt = _prompt(1)
    first = runner.generate(first_prompt, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert list(first.token_ids) == _hf_generate(hybrid, first_prompt, NEW_TOKENS)
    # The next turn: the whole first exchange and a new question.  The answer's last token has no K/V yet, so the
    # deepest state is the one kept when the answer ended, one token short of the exchange.
    second_prompt = first_prompt + list(first.token_ids) + _prompt(2, 9)
    second = runner.generate(second_prompt, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert second.usage.cached_tokens == PROMPT_LENGTH + NEW_TOKENS - 1
    assert second.usage.unresumed_tokens == 0
    assert list(second.token_ids) == _hf_generate(hybrid, second_prompt, NEW_TOKENS)
    stats = runner.cache.stats()
    assert stats.num_states >= 2 and stats.state_bytes == stats.num_states * hybrid.state_bytes


def test_a_prompt_matching_past_every_kept_state_resumes_at_the_deepest_and_says_how_many_it_could_not(hybrid):
    runner = PrefixCachingRunner(hybrid, cache_tokens=1024, block_size=BLOCK_SIZE)
    long_prompt = _prompt(3, 60)
    runner.generate(long_prompt, SamplingParams(max_new_tokens=0))  # a state at 60 only
    # Shares 40 tokens with the cached prompt: their K/V are cached, but no state stands inside them.
    shorter = long_prompt[:40] + _prompt(4, 10)
    result = runner.generate(shorter, SamplingParams(max_new_tokens=3), return_logits=True)
    assert result.usage.cached_tokens == 0 and result.usage.unresumed_tokens == 40
    torch.testing.assert_close(
        result.prompt_logits,
        hybrid.forward_reference(torch.tensor(shorter), return_logits=True),
        atol=SPLIT_ATOL,
        rtol=0,
    )
    again = runner.generate(long_prompt + _prompt(5, 7), SamplingParams(max_new_tokens=0))
    assert again.usage.cached_tokens == 60 and again.usage.unresumed_tokens == 0


def test_the_batching_engine_serves_hybrid_rows_as_serial_calls_do(hybrid):
    system = _prompt(6, 40)
    prompts = [system + _prompt(10 + i, 3 + 5 * i) for i in range(3)]
    serial = PrefixCachingRunner(hybrid, cache_tokens=2048, block_size=BLOCK_SIZE)
    serial.generate(system, SamplingParams(max_new_tokens=0))
    expected = [serial.generate(p, SamplingParams(max_new_tokens=NEW_TOKENS)).token_ids for p in prompts]
    runner = PrefixCachingRunner(hybrid, cache_tokens=2048, block_size=BLOCK_SIZE)
    runner.generate(system, SamplingParams(max_new_tokens=0))
    engine = BatchEngine(runner, max_batch_tokens=24)  # prompts in chunks, decode rows beside them
    handles = [engine.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    engine.run_until_idle()
    results = [h.result() for h in handles]
    assert [r.token_ids for r in results] == expected
    assert all(r.usage.cached_tokens == len(system) for r in results)
    assert_quiescent(runner.cache)


def test_a_repeated_prompt_resumes_before_its_last_token_and_inner_states_serve_a_shared_prefix(hybrid):
    runner = PrefixCachingRunner(hybrid, cache_tokens=1024, block_size=BLOCK_SIZE, state_interval_blocks=1)
    prompt = _prompt(7, 60)
    first = runner.generate(prompt, SamplingParams(max_new_tokens=2))
    positions = runner.cache.state_positions(prompt + list(first.token_ids), runner.namespace_key(None))
    assert positions == [16, 32, 48, 59, 60, 61]
    again = runner.generate(prompt, SamplingParams(max_new_tokens=2))
    assert again.usage.cached_tokens == 59 and again.usage.unresumed_tokens == 0
    # Another question behind the first 40 tokens: the deepest inner state is at 32.
    other = prompt[:40] + _prompt(8, 9)
    result = runner.generate(other, SamplingParams(max_new_tokens=3))
    assert result.usage.cached_tokens == 32 and result.usage.unresumed_tokens == 8
    assert list(result.token_ids) == _hf_generate(hybrid, other, 3)
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("source", ["model-config", "hf-folder"])
def test_the_replay_takes_a_hybrid_model_and_verifies_it(tmp_path, source, capsys):
    from prefixcache.cli import main

    folder = tmp_path / "tiny-qwen3-next"
    config = tiny_hf_config("qwen3_next", max_position_embeddings=8192)
    if source == "hf-folder":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        model_args = ["--model", f"hf:{folder}"]
    else:
        config.save_pretrained(folder)
        model_args = ["--model-config", str(folder / "config.json")]
    scenario = Path(__file__).resolve().parents[2] / "scenarios" / "multi_turn_chat.jsonl"
    out = tmp_path / "report.json"
    args = ["replay", str(scenario), *model_args, "--verify", "--limit", "4", "--no-progress", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["requests"] > 4 and report["cached_tokens"] > 0  # four conversations, every turn verified
    assert 0 <= report["max_abs_logit_diff"] <= 5e-3
    assert "Qwen3NextForCausalLM" in capsys.readouterr().out


def test_a_request_preempted_mid_prompt_with_prompt_logits_resumes_and_keeps_the_state_before_its_last_token(hybrid):
    # The first request decodes past its block while the second, admitted after it, is still prefilling: the second
    # is preempted inside its prompt.  Owing prompt logits, it resumes matching no further than its first missing row.
    runner = PrefixCachingRunner(hybrid, cache_tokens=64, block_size=BLOCK_SIZE, state_interval_blocks=0)
    engine = BatchEngine(runner, max_batch_tokens=8)
    first, second = _prompt(11, 15), _prompt(12, 40)
    decoding = engine.submit(first, SamplingParams(max_new_tokens=20))
    preempted = engine.submit(second, SamplingParams(max_new_tokens=3), return_logits=True)
    engine.run_until_idle()
    assert engine.core.preempted_requests == 1
    result = preempted.result()
    assert list(result.token_ids) == _hf_generate(hybrid, second, 3)
    torch.testing.assert_close(
        result.prompt_logits,
        hybrid.forward_reference(torch.tensor(second), return_logits=True),
        atol=SPLIT_ATOL,
        rtol=0,
    )
    assert list(decoding.result().token_ids) == _hf_generate(hybrid, first, 20)
    assert len(second) - 1 in runner.cache.state_positions(second, runner.namespace_key(None))
    assert_quiescent(runner.cache)
    engine.close()


@pytest.mark.parametrize("model_type", HYBRID_MODEL_TYPES)
def test_a_bf16_hybrid_is_served_and_its_greedy_output_equals_generate(model_type):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(model_type)).eval().to(torch.bfloat16)
    wrapped = HFCausalLM(model)  # the wrap-time resume check takes bf16 rounding for what it is
    prompt = _prompt(13, 40)
    runner = PrefixCachingRunner(wrapped, cache_tokens=1024, block_size=BLOCK_SIZE)
    assert list(runner.generate(prompt, SamplingParams(max_new_tokens=4)).token_ids) == _hf_generate(wrapped, prompt, 4)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba"])
def test_the_wrap_time_probe_alone_refuses_a_prefill_that_restarts_the_scan(monkeypatch, model_type, seed):
    import prefixcache.models.hf_support as support

    monkeypatch.setattr(support, "_RECURRENT_MODEL_TYPES", frozenset())  # the probe, not the list of known types
    config = transformers.AutoConfig.for_model(
        model_type, hidden_size=64, num_hidden_layers=2, state_size=4, vocab_size=300, initializer_range=0.2
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match="does not continue a kept recurrent state"):
        HFCausalLM(model)
