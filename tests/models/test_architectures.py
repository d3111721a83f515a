"""Specification of the Hugging Face adapter across architectures: every served model type, built from a tiny random
config, decodes greedily as its own ``generate`` does, returns the logits of its uncached positions as its own forward
does (fp32, 1e-5) after a cached prefix several times the attention window, hits a shared prefix, and batches as it
runs alone.  Hybrid and recurrent ones (Qwen3-Next, Nemotron-H, Granite-4.0-H, MiniMax, Mamba-2) resume from state
snapshots and match the uncached forward within the rounding of a split scan; Mamba-1, whose prefill does not continue
a kept state, is refused with a reason.

Sliding-window models get a window of 32 and layer types that mix sliding and full layers, Llama 4 a chunk of 32, MoE
models a few small experts, DeepSeek small latent sizes (a latent K of 16 and a rotary V of 8, packed in the pool).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from prefixcache.cache.pool import kv_bytes_per_token  # noqa: E402
from prefixcache.engine.batching import BatchEngine  # noqa: E402
from prefixcache.engine.runner import PrefixCachingRunner, SamplingParams  # noqa: E402
from prefixcache.errors import UnsupportedModelError  # noqa: E402
from prefixcache.models.base import BatchRow, LiveKV, kv_pool_shape  # noqa: E402
from prefixcache.models.hf import TESTED_MODEL_TYPES, HFCausalLM, random_model_from_config  # noqa: E402
from prefixcache.models.hf_support import KVLayout  # noqa: E402

TOL = 1e-5
VOCAB = 300
WINDOW = 32
PREFIX = 96  # three windows: a cached prefix reaches well past every sliding window and chunk
NEW_TOKENS = 8

_BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
_SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
# Latent attention: transformers caches one head of the kv_lora_rank latent (as K) and the rotary key (as V).
_LATENT = {
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 12,
}

# model type -> (config overrides, served).  Served ones must be exact; the others must be refused.
ARCHITECTURES: dict[str, tuple[dict, bool]] = {
    "llama": ({}, True),
    "mistral": ({"sliding_window": WINDOW}, True),
    "qwen2": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}, True),
    "qwen3": ({"head_dim": 16}, True),
    "qwen3_moe": ({"head_dim": 16, "num_experts": 4, **_MOE}, True),
    "gemma": ({"head_dim": 16}, True),
    "gemma2": ({"head_dim": 16, "sliding_window": WINDOW, "num_hidden_layers": 3}, True),
    "gemma3_text": (
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
        True,
    ),
    "gpt_oss": (
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": _SLIDING_THEN_FULL,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "rope_theta": 150000.0,
            },
        },
        True,
    ),
    "cohere2": ({"sliding_window": WINDOW, "layer_types": _SLIDING_THEN_FULL}, True),
    "exaone4": ({"sliding_window": WINDOW, "layer_types": _SLIDING_THEN_FULL}, True),
    "llama4_text": (
        {
            "head_dim": 16,
            "attention_chunk_size": WINDOW,
            "num_local_experts": 2,
            "intermediate_size_mlp": 128,
            "layer_types": ["chunked_attention", "full_attention"],
            "no_rope_layers": [1, 0],  # the full layer has no RoPE and temperature-tuned queries
        },
        True,
    ),
    "deepseek_v2": ({**_LATENT, "n_routed_experts": 4, "first_k_dense_replace": 1, **_MOE}, True),
    "deepseek_v3": (
        {
            **_LATENT,
            "n_routed_experts": 4,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            **_MOE,
        },
        True,
    ),
    "glm4_moe": (
        {"head_dim": 16, "n_routed_experts": 4, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, **_MOE},
        True,
    ),
    "phi3": ({}, True),
    "olmo2": ({}, True),
    "gpt2": ({"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512}, True),
    "qwen3_next": (
        {
            "head_dim": 16,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "layer_types": ["linear_attention", "full_attention"],
        },
        True,
    ),
    "nemotron_h": (
        {
            "head_dim": 16,
            "hybrid_override_pattern": "M*",
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "ssm_state_size": 8,
            "n_groups": 1,
        },
        True,
    ),
    "granitemoehybrid": (
        {
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "layer_types": ["mamba", "attention"],
            "mamba_n_heads": 4,
            "mamba_d_head": 32,
            "mamba_d_state": 8,
            "mamba_n_groups": 1,
        },
        True,
    ),
    "minimax": (
        {
            "head_dim": 16,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "layer_types": ["linear_attention", "full_attention"],
        },
        True,
    ),
    "mamba2": ({"num_heads": 4, "head_dim": 32, "state_size": 8, "n_groups": 1, "expand": 2}, True),
    # Mamba-1's prefill of several tokens restarts its scan from zeros instead of continuing a kept state.
    "mamba": ({"state_size": 8}, False),
    "falcon_mamba": ({"state_size": 8}, False),
}
SERVED = sorted(name for name, (_, served) in ARCHITECTURES.items() if served)
REFUSED = sorted(name for name, (_, served) in ARCHITECTURES.items() if not served)
RECURRENT = {"qwen3_next", "nemotron_h", "granitemoehybrid", "minimax", "mamba2"}
# A recurrent layer's chunked scan rounds differently when its forward is split where the prefill keeps states: against
# the unsplit forward these tiny models differ by up to ~5e-4 (equal to the model's own forward split at the same
# places: tests/models/test_hf_hybrid.py).
SPLIT_ATOL = 2e-3
WINDOWED = {"mistral", "qwen2", "gemma2", "gemma3_text", "gpt_oss", "cohere2", "exaone4", "llama4_text"}


def _config(model_type: str):
    overrides, _ = ARCHITECTURES[model_type]
    base = _BASE if model_type != "gpt2" else {k: _BASE[k] for k in ("vocab_size", "initializer_range")}
    return transformers.AutoConfig.for_model(model_type, **{**base, **overrides})


def _hf_model(model_type: str):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(_config(model_type)).eval()


_WRAPPED: dict[str, HFCausalLM] = {}


@pytest.fixture(scope="module", params=SERVED)
def wrapped(request) -> HFCausalLM:
    if request.param not in _WRAPPED:
        _WRAPPED[request.param] = HFCausalLM(_hf_model(request.param))
    return _WRAPPED[request.param]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(model: HFCausalLM) -> PrefixCachingRunner:
    # A recurrent model keeps a state every block of a prompt, so that a shared prefix of whole blocks resumes.
    return PrefixCachingRunner(model, None, cache_tokens=2048, block_size=16, state_interval_blocks=1)


def _own_greedy(model: HFCausalLM, prompt: list[int]) -> list[int]:
    out = model.model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


def test_every_served_type_is_listed_as_tested() -> None:
    assert set(SERVED) <= TESTED_MODEL_TYPES
    assert not set(REFUSED) & TESTED_MODEL_TYPES


def test_greedy_generation_equals_the_models_own_generate(wrapped: HFCausalLM) -> None:
    prompt = _ids(PREFIX + 10, seed=1)
    result = _runner(wrapped).generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert list(result.token_ids) == _own_greedy(wrapped, prompt)


def test_logits_after_a_long_cached_prefix_equal_the_full_forward(wrapped: HFCausalLM) -> None:
    prompt = _ids(PREFIX + 24, seed=2)
    runner = _runner(wrapped)
    runner.generate(prompt[: PREFIX - 5], SamplingParams(max_new_tokens=0))  # ends inside a block

    result = runner.generate(prompt, SamplingParams(max_new_tokens=0), return_logits=True)

    assert result.usage.cached_tokens == PREFIX - 5
    tolerance = SPLIT_ATOL if wrapped.recurrent else TOL
    reference = wrapped.forward_reference(torch.tensor(prompt), return_logits=True)
    torch.testing.assert_close(result.prompt_logits, reference[PREFIX - 5 :], atol=tolerance, rtol=0)
    with torch.no_grad():
        own = wrapped.model(input_ids=torch.tensor([prompt])).logits[0, PREFIX - 5 :].float()
    torch.testing.assert_close(result.prompt_logits, own, atol=tolerance, rtol=0)


def test_a_second_request_hits_the_shared_prefix_and_decodes_the_same(wrapped: HFCausalLM) -> None:
    shared = _ids(PREFIX, seed=3)
    first, second = shared + _ids(7, seed=4), shared + _ids(12, seed=5)
    runner = _runner(wrapped)
    runner.generate(first, SamplingParams(max_new_tokens=NEW_TOKENS))

    result = runner.generate(second, SamplingParams(max_new_tokens=NEW_TOKENS))

    assert result.usage.cached_tokens == PREFIX
    assert list(result.token_ids) == _own_greedy(wrapped, second)


def test_batch_engine_equals_serial_for_prompts_of_different_lengths(wrapped: HFCausalLM) -> None:
    shared = _ids(PREFIX - 16, seed=6)
    prompts = [shared + _ids(n, seed=7 + n) for n in (3, 11, 20)]
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS)
    serial = [list(_runner(wrapped).generate(p, sampling).token_ids) for p in prompts]

    engine = BatchEngine(_runner(wrapped), max_batch_tokens=64)
    handles = [engine.submit(p, sampling) for p in prompts]
    engine.run_until_idle()

    assert [list(h.result().token_ids) for h in handles] == serial


@pytest.mark.parametrize("model_type", sorted(WINDOWED))
def test_windowed_models_are_accepted_with_their_windowed_layers_named(model_type: str) -> None:
    wrapped = HFCausalLM(_hf_model(model_type)) if model_type not in _WRAPPED else _WRAPPED[model_type]
    support = wrapped.support
    assert support.windowed_layers and support.window == WINDOW and support.needs_equal_starts
    config = wrapped.config
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    assert support.windowed_layers == tuple(i for i, t in enumerate(layer_types) if t != "full_attention")


def test_full_attention_models_batch_rows_of_any_start() -> None:
    assert not HFCausalLM(_hf_model("llama")).support.needs_equal_starts


def test_windowed_batch_rows_past_the_window_equal_their_references() -> None:
    """Gemma 3: two rows at the same start (batched, no gap) and one at another start (run alone), each prefix past
    the window, then decode steps together."""
    model = _WRAPPED.get("gemma3_text") or HFCausalLM(_hf_model("gemma3_text"))
    block = 16
    kv = torch.zeros(kv_pool_shape(model, 40, block), dtype=model.dtype)
    sequences = [_ids(90, seed=20), _ids(90, seed=21), _ids(130, seed=22)]
    tables = [torch.arange(0, 10), torch.arange(10, 20), torch.arange(20, 30)]
    lives = [LiveKV() for _ in sequences]
    starts = [85, 85, 120]
    for seq, table, live, start in zip(sequences, tables, lives, starts, strict=True):
        model.forward_cached(torch.tensor(seq[:start]), 0, kv, table, live=live)
    contexts = [seq[:start] for seq, start in zip(sequences, starts, strict=True)]
    for step in range(4):
        chunks = (
            [seq[start : start + 5] for seq, start in zip(sequences, starts, strict=True)]
            if step == 0
            else [[(ctx[-1] + step) % VOCAB] for ctx in contexts]
        )
        rows = [
            BatchRow(torch.tensor(chunk), len(ctx), table, live)
            for chunk, ctx, table, live in zip(chunks, contexts, tables, lives, strict=True)
        ]
        outs = model.forward_batch(rows, kv)
        for b, chunk in enumerate(chunks):
            contexts[b] = contexts[b] + chunk
            reference = model.forward_reference(torch.tensor(contexts[b]))
            torch.testing.assert_close(outs[b], reference, atol=TOL, rtol=0)
            assert lives[b].num_tokens == len(contexts[b])


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_latent_attention_pool_holds_the_latent_and_rotary_key_packed(model_type: str) -> None:
    model = _WRAPPED.get(model_type) or HFCausalLM(_hf_model(model_type))
    assert model.kv_layout == KVLayout(num_kv_heads=1, key_dim=16, value_dim=8)
    assert (model.num_kv_heads, model.head_dim) == (1, 12)
    per_token = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype)
    assert per_token == model.num_layers * (16 + 8) * 4  # no padding


def test_kv_layout_packs_and_unpacks_k_and_v_of_different_sizes() -> None:
    layout = KVLayout(num_kv_heads=3, key_dim=5, value_dim=2)  # 21 elements a head pair: one element of padding
    assert layout.packed and layout.head_dim == 4
    keys, values = torch.randn(2, 7, 3, 5), torch.randn(2, 7, 3, 2)
    rows = layout.pack(keys, values)
    assert rows.shape == (2, 2, 7, 3, 4)
    back_keys, back_values = layout.unpack(rows.movedim(0, 1))  # [B, 2, n, H, D], the layout of pool rows
    assert torch.equal(back_keys, keys) and torch.equal(back_values, values)
    plain = KVLayout(num_kv_heads=3, key_dim=4, value_dim=4)
    assert not plain.packed and plain.head_dim == 4
    k, v = plain.unpack(plain.pack(keys[..., :4], values.repeat(1, 1, 1, 2)).movedim(0, 1))
    assert torch.equal(k, keys[..., :4]) and torch.equal(v, values.repeat(1, 1, 1, 2))


@pytest.mark.parametrize("model_type", REFUSED)
def test_recurrent_models_that_cannot_resume_a_state_are_refused_with_a_reason(model_type: str) -> None:
    model = _hf_model(model_type)
    with torch.no_grad():  # the config itself is sound: the model runs on its own
        logits = model(input_ids=torch.tensor([_ids(6, seed=30)])).logits
    assert logits.shape == (1, 6, VOCAB)
    with pytest.raises(UnsupportedModelError, match=r"recurrent|linear"):
        HFCausalLM(model)


def test_bidirectional_gemma3_is_refused() -> None:
    config = _config("gemma3_text")
    config.use_bidirectional_attention = True
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        HFCausalLM(model)


def test_cli_replays_a_gemma3_config_sliced_to_fewer_layers(tmp_path: Path) -> None:
    from prefixcache.cli import main

    config = {"model_type": "gemma3_text", **_BASE, **ARCHITECTURES["gemma3_text"][0], "vocab_size": 1000}
    config.update(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    sliced = random_model_from_config(tmp_path, layers=2)
    assert sliced.config.layer_types == ["sliding_attention", "full_attention"]
    assert sliced.support.windowed_layers == (0,)
    system = {"role": "system", "content": "You are terse. " * 12}
    chats = [
        {
            "id": f"c{i}",
            "messages": [system, {"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": "A"}],
        }
        for i in range(2)
    ]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    out = tmp_path / "report.json"
    argv = ["replay", str(tmp_path / "chats.jsonl"), "--model-config", str(tmp_path / "config.json"), "--layers", "2"]
    assert main([*argv, "--verify", "--no-progress", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "Gemma3ForCausalLM(2 layers)"
    assert report["verified"] is True and report["cached_tokens"] > 0
