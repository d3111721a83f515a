"""Specification of the Hugging Face adapters: cached prefill of a transformers model is exact against the model's
own forward and generate, unsupported architectures are refused, and local tokenizer folders render chats with
their own template.  Everything is built from small configs with random weights; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from prefixcache.chat.hf_tokenizer import HFTokenizer  # noqa: E402
from prefixcache.chat.tokenizer import Tokenizer  # noqa: E402
from prefixcache.engine.runner import PrefixCachingRunner, SamplingParams  # noqa: E402
from prefixcache.errors import InvalidArgumentError, TemplateError, UnsupportedModelError  # noqa: E402
from prefixcache.models.base import CausalLM, kv_pool_shape  # noqa: E402
from prefixcache.models.hf import HFCausalLM, load_hf_model, random_model_from_config  # noqa: E402

TOL = 1e-5
VOCAB = 1000

# 2 layers, hidden 64, 4 heads (2 KV heads where the architecture has GQA).  initializer_range 0.2 instead of the
# usual 0.02 spreads the logits, so greedy decoding wanders instead of repeating one token.  No BOS/EOS ids, so
# model.generate never stops early.
_COMMON = {"vocab_size": VOCAB, "initializer_range": 0.2, "bos_token_id": None, "eos_token_id": None}
_DECODER = {
    **_COMMON,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
CONFIGS = {
    "llama": _DECODER,
    "qwen2": _DECODER,
    "gpt2": {**_COMMON, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512},
}


def _hf_model(model_type: str, seed: int = 0, **overrides):
    config = transformers.AutoConfig.for_model(model_type, **{**CONFIGS.get(model_type, _DECODER), **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def wrapped(request) -> HFCausalLM:
    return HFCausalLM(_hf_model(request.param))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(model: HFCausalLM, block_size: int) -> PrefixCachingRunner:
    return PrefixCachingRunner(model, None, cache_tokens=2048, block_size=block_size)


def test_adapter_reads_sizes_from_config_and_implements_protocol(wrapped: HFCausalLM) -> None:
    assert isinstance(wrapped, CausalLM)
    kv_heads = 4 if wrapped.config.model_type == "gpt2" else 2
    assert (wrapped.num_layers, wrapped.num_kv_heads, wrapped.head_dim) == (2, kv_heads, 16)
    assert (wrapped.vocab_size, wrapped.max_position) == (VOCAB, 512)
    assert wrapped.dtype == torch.float32 and wrapped.device == torch.device("cpu")


def test_reference_is_the_models_own_forward(wrapped: HFCausalLM) -> None:
    ids = torch.tensor(_ids(30, seed=1))
    with torch.no_grad():
        own = wrapped.model(input_ids=ids[None]).logits[0]
    assert torch.equal(wrapped.forward_reference(ids, return_logits=True), own.float())


# Cached: the first request caches `cached` tokens; the second shares them and goes on to 70 tokens.
HITS = {
    "ending_at_block_boundary": (32, 32),
    "ending_inside_block": (37, 37),
    "diverging_inside_a_cached_block": (60, 37),  # cache 60 tokens, share only the first 37
}


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("hit", sorted(HITS))
def test_cache_hit_logits_equal_full_forward(wrapped: HFCausalLM, block_size: int, hit: str) -> None:
    cached_len, shared = HITS[hit]
    first = _ids(cached_len, seed=2)
    prompt = first[:shared] + _ids(70 - shared, seed=3)
    runner = _runner(wrapped, block_size)
    runner.generate(first, SamplingParams(max_new_tokens=0))

    result = runner.generate(prompt, SamplingParams(max_new_tokens=0), return_logits=True)

    assert result.usage.cached_tokens == shared
    reference = wrapped.forward_reference(torch.tensor(prompt), return_logits=True)
    torch.testing.assert_close(result.prompt_logits, reference[shared:], atol=TOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_generation_matches_hf_generate_across_turns(wrapped: HFCausalLM, block_size: int) -> None:
    runner = _runner(wrapped, block_size)
    sampling = SamplingParams(max_new_tokens=24)
    prompt = _ids(20, seed=4)
    for turn in range(2):
        result = runner.generate(prompt, sampling)
        expected = wrapped.model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=None
        )[0, len(prompt) :]
        assert list(result.token_ids) == expected.tolist()
        # Turn 2 reuses turn 1's prompt and the K/V its decode steps wrote: all but the 7 new tokens and the last
        # generated token, which was sampled but never fed back.
        assert result.usage.cached_tokens == (0 if turn == 0 else len(prompt) - 8)
        prompt = prompt + list(result.token_ids) + _ids(7, seed=5)


def test_cached_call_writes_only_its_own_slots(wrapped: HFCausalLM) -> None:
    block_size, num_blocks = 4, 12
    kv = torch.full(kv_pool_shape(wrapped, num_blocks, block_size), float("nan"))
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(6))
    ids = torch.tensor(_ids(23, seed=7))
    wrapped.forward_cached(ids[:13], 0, kv, table)
    before = kv.clone()

    wrapped.forward_cached(ids[13:], 13, kv, table)

    positions = torch.arange(13, 23)
    new_slots = table[positions // block_size] * block_size + positions % block_size
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[new_slots] = True
    flat_before = before.view(wrapped.num_layers, 2, -1, wrapped.num_kv_heads, wrapped.head_dim)
    flat_after = kv.view_as(flat_before)
    torch.testing.assert_close(flat_after[:, :, ~written], flat_before[:, :, ~written], atol=0, rtol=0, equal_nan=True)
    assert not flat_after[:, :, written].isnan().any()


def test_fingerprint_is_stable_and_tells_weights_and_dtype_apart() -> None:
    a, b = HFCausalLM(_hf_model("llama", seed=0)), HFCausalLM(_hf_model("llama", seed=0))
    other_seed = HFCausalLM(_hf_model("llama", seed=1))
    half = HFCausalLM(_hf_model("llama", seed=0).to(torch.bfloat16))
    assert a.fingerprint() == b.fingerprint()
    assert len({a.fingerprint(), other_seed.fingerprint(), half.fingerprint()}) == 3


UNSUPPORTED = {
    "mamba": ("mamba", {"hidden_size": 64, "num_hidden_layers": 2, "state_size": 4}),
    "llama_with_dynamic_rope": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}),
    "qwen3_next_hybrid": (
        "qwen3_next",
        {"head_dim": 16, "num_experts": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    ),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_architectures_raise(name: str) -> None:
    model_type, overrides = UNSUPPORTED[name]
    config = dict(_DECODER, **overrides) if model_type != "mamba" else dict(_COMMON, **overrides)
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    with pytest.raises(UnsupportedModelError, match=r"sliding|recurrent|per-token K/V|rotary"):
        HFCausalLM(model)


def test_mistral_without_window_is_served_exactly() -> None:
    wrapped = HFCausalLM(_hf_model("mistral", sliding_window=None))
    runner = _runner(wrapped, 16)
    prompt = _ids(50, seed=8)
    runner.generate(prompt[:21], SamplingParams(max_new_tokens=0))
    result = runner.generate(prompt, SamplingParams(max_new_tokens=0), return_logits=True)
    assert result.usage.cached_tokens == 21
    torch.testing.assert_close(
        result.prompt_logits, wrapped.forward_reference(torch.tensor(prompt), return_logits=True)[21:], atol=TOL, rtol=0
    )


def test_load_hf_model_reads_a_saved_folder(tmp_path: Path) -> None:
    model = _hf_model("qwen2", seed=9)
    model.save_pretrained(tmp_path)
    loaded = load_hf_model(tmp_path, device="cpu")
    ids = torch.tensor(_ids(12, seed=10))
    assert loaded.fingerprint() == HFCausalLM(model).fingerprint()
    torch.testing.assert_close(
        loaded.forward_reference(ids, return_logits=True),
        HFCausalLM(model).forward_reference(ids, return_logits=True),
        atol=0,
        rtol=0,
    )


def test_load_hf_model_rejects_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="not a folder"):
        load_hf_model(tmp_path / "absent")


def test_random_model_from_config_scales_layers_and_is_seeded(tmp_path: Path) -> None:
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "torch_dtype": "bfloat16", **_DECODER}
    config.update(num_hidden_layers=6, use_sliding_window=False, sliding_window=4096)
    (tmp_path / "config.json").write_text(json.dumps(config))

    a = random_model_from_config(tmp_path / "config.json", layers=3, seed=1)
    b = random_model_from_config(tmp_path, layers=3, seed=1)
    c = random_model_from_config(tmp_path, layers=3, seed=2)

    assert type(a.model).__name__ == "Qwen2ForCausalLM" and a.num_layers == 3 and len(a.model.model.layers) == 3
    assert a.dtype == torch.float32
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


def test_random_model_from_config_rejects_bad_layers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **_DECODER}))
    with pytest.raises(InvalidArgumentError, match="layers"):
        random_model_from_config(tmp_path, layers=0)


# ---- tokenizer ------------------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_reservation_details",
            "description": "Get the details of a reservation.",
            "parameters": {"type": "object", "properties": {"reservation_id": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> HFTokenizer:
    return HFTokenizer(qwen_dir)


def test_hf_tokenizer_implements_protocol_with_real_ids(qwen: HFTokenizer) -> None:
    assert isinstance(qwen, Tokenizer)
    assert qwen.vocab_size == 151665
    assert qwen.special_token_id("<|im_start|>") == 151644 and qwen.special_token_id("<|im_end|>") == 151645
    assert {151643, 151645} <= qwen.eos_token_ids
    assert qwen.name.startswith("Qwen2Tokenizer:qwen2.5-0.5b-instruct:")
    assert qwen.decode(qwen.encode("Hello, world!")) == "Hello, world!"


def test_hf_tokenizer_encodes_special_token_text_as_plain_text(qwen: HFTokenizer) -> None:
    ids = qwen.encode("a <|im_end|> b")
    assert 151645 not in ids and qwen.decode(ids) == "a <|im_end|> b"


def test_hf_tokenizer_rejects_unknown_specials_and_out_of_range_ids(qwen: HFTokenizer) -> None:
    from prefixcache.errors import InvalidTokensError

    with pytest.raises(InvalidArgumentError, match="unknown special token"):
        qwen.special_token_id("<|nope|>")
    with pytest.raises(InvalidTokensError, match="outside"):
        qwen.decode([qwen.vocab_size])


def test_render_chat_uses_the_folders_template_with_tools(qwen: HFTokenizer) -> None:
    messages = [{"role": "system", "content": "You are an airline agent."}, {"role": "user", "content": "Hi"}]
    ids = qwen.render_chat(messages, TOOLS, add_generation_prompt=True)
    text = qwen.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are an airline agent.\n\n# Tools")
    assert '"name": "get_reservation_details"' in text
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids == qwen.tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_render_chat_rejects_bad_messages(qwen: HFTokenizer) -> None:
    with pytest.raises(TemplateError, match="role"):
        qwen.render_chat([{"role": "narrator", "content": "x"}])


def test_hf_tokenizer_rejects_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="not a folder"):
        HFTokenizer(tmp_path / "absent")


def test_runner_reuses_a_shared_system_prompt_with_qwen_ids(qwen: HFTokenizer) -> None:
    model = HFCausalLM(_hf_model("qwen2", vocab_size=151936))
    runner = PrefixCachingRunner(model, qwen, cache_tokens=4096, block_size=16)
    system = {"role": "system", "content": "You are a helpful airline agent. " * 8}
    first = qwen.render_chat([system, {"role": "user", "content": "Where is my bag?"}])
    second = qwen.render_chat([system, {"role": "user", "content": "Change my seat."}])
    shared = next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)

    runner.generate(first, SamplingParams(max_new_tokens=4))
    result = runner.generate(second, SamplingParams(max_new_tokens=4), return_logits=True)

    assert result.usage.cached_tokens == shared
    reference = model.forward_reference(torch.tensor(second), return_logits=True)[shared:]
    torch.testing.assert_close(result.prompt_logits, reference, atol=TOL, rtol=0)


# ---- command line ---------------------------------------------------------------------------------------------


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    system = {"role": "system", "content": "You are terse."}
    lines = [
        {
            "id": f"c{i}",
            "messages": [system, {"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": "A"}],
        }
        for i in range(2)
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _replay_json(argv: list[str], out: Path) -> dict:
    from prefixcache.cli import main

    assert main([*argv, "--no-progress", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_cli_replays_a_random_model_from_config_with_verify(chat_file: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen2", **_DECODER}))
    report = _replay_json(
        ["replay", str(chat_file), "--model-config", str(config), "--layers", "1", "--verify"], tmp_path / "r.json"
    )
    assert report["model"] == "Qwen2ForCausalLM(1 layers)"
    assert report["verified"] is True and report["cached_tokens"] > 0


def test_cli_replays_a_saved_model_folder(chat_file: Path, tmp_path: Path) -> None:
    _hf_model("gpt2").save_pretrained(tmp_path / "gpt2")
    report = _replay_json(
        ["replay", str(chat_file), "--model", f"hf:{tmp_path / 'gpt2'}", "--verify"], tmp_path / "r.json"
    )
    assert report["model"] == "GPT2LMHeadModel(2 layers)" and report["verified"] is True


def test_cli_refuses_layers_without_model_config(chat_file: Path) -> None:
    from prefixcache.cli import main

    assert main(["replay", str(chat_file), "--layers", "2", "--no-progress"]) == 2


@pytest.mark.parametrize("cached", [0, 17])
def test_last_position_logits_equal_the_full_forward_with_the_last_mlp_on_one_row(
    wrapped: HFCausalLM, cached: int
) -> None:
    # The last layer's MLP runs on the last position only where just its logits are kept (llama, qwen2 here; gpt2's
    # is left whole); the logits and the K/V written for every position stay the full forward's.
    prompt = _ids(40, seed=11)
    kv = torch.zeros(kv_pool_shape(wrapped, 8, 16), dtype=wrapped.dtype)
    table = torch.arange(8)
    if cached:
        wrapped.forward_cached(torch.tensor(prompt[:cached]), 0, kv, table)
    last = wrapped.forward_cached(torch.tensor(prompt[cached:]), cached, kv, table)
    full = torch.zeros_like(kv)
    every = wrapped.forward_cached(torch.tensor(prompt), 0, full, table, return_logits=True)
    reference = wrapped.forward_reference(torch.tensor(prompt))
    torch.testing.assert_close(last, reference, atol=TOL, rtol=0)
    torch.testing.assert_close(every[-1:], reference, atol=TOL, rtol=0)
    torch.testing.assert_close(kv, full, atol=TOL, rtol=0)
    mlp = wrapped.head.last_mlp
    assert (mlp is not None) == (wrapped.config.model_type in {"llama", "qwen2"})
    if mlp is not None:
        assert not mlp._forward_pre_hooks


def test_last_position_mlp_slices_inside_the_block_and_is_removed_on_error() -> None:
    from prefixcache.models.hf_last_position import last_layer_mlp, last_position_mlp

    model = _hf_model("qwen2")
    mlp = last_layer_mlp(model.model, model.config)
    assert mlp is model.model.layers[-1].mlp
    x = torch.randn(2, 5, 64)
    with torch.no_grad(), last_position_mlp(mlp):
        inside = mlp(x)
    assert inside.shape == (2, 1, 64)
    with torch.no_grad():
        torch.testing.assert_close(inside, mlp(x)[:, -1:], atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="boom"), last_position_mlp(mlp):
        raise RuntimeError("boom")
    assert not mlp._forward_pre_hooks
    with last_position_mlp(None):
        pass
    # Other model types, and a last layer whose MLP is not a dense *MLP module, keep their whole last layer.
    gpt2 = _hf_model("gpt2")
    assert last_layer_mlp(gpt2.transformer, gpt2.config) is None
    model.model.layers[-1].mlp = torch.nn.Identity()
    assert last_layer_mlp(model.model, model.config) is None
