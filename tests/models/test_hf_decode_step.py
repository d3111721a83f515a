"""Specification of the HF adapter's own decode step (``models/hf_decode_step.py``): a one-token step of a Llama-family
model run layer by layer from the model's own modules gives the model's own logits and K/V bit for bit, is taken
only where it computes what the model would (no sliding window, no hooks it would skip, transformers' own classes),
and decode through the runner stays exact."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from prefixcache.engine.runner import PrefixCachingRunner  # noqa: E402
from prefixcache.engine.sampling import SamplingParams  # noqa: E402
from prefixcache.models import hf_decode_step  # noqa: E402
from prefixcache.models.base import LiveKV, kv_pool_shape  # noqa: E402
from prefixcache.models.hf_decode_step import decode_layers  # noqa: E402
from prefixcache.models.hf_tiny import tiny_random_model  # noqa: E402

TYPES = ["llama", "qwen2", "mistral", "qwen3"]


def _step_logits(model, prompt: list[int], token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill of ``prompt`` into a live cache, then one decode step of ``token``: its logits and the pool."""
    kv = torch.zeros(kv_pool_shape(model, 8, 16), dtype=model.dtype)
    table, live = torch.arange(8), LiveKV()
    model.forward_cached(torch.tensor(prompt), 0, kv, table, live=live)
    logits = model.forward_cached(torch.tensor([token]), len(prompt), kv, table, live=live)
    return logits, kv


@pytest.mark.parametrize("model_type", TYPES)
def test_own_step_equals_the_models_path_bit_for_bit(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_random_model(model_type, max_positions=256)
    prompt = torch.randint(0, 300, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    taken = []
    real = hf_decode_step.decode_hidden
    monkeypatch.setattr(hf_decode_step, "decode_hidden", lambda *args: taken.append(1) or real(*args))
    ours, our_pool = _step_logits(model, prompt, 17)
    assert taken == [1]
    monkeypatch.setattr(hf_decode_step, "decode_layers", lambda base, config: None)
    theirs, their_pool = _step_logits(model, prompt, 17)
    assert taken == [1]
    assert torch.equal(ours, theirs) and torch.equal(our_pool, their_pool)
    reference = model.forward_reference(torch.tensor([*prompt, 17]))
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", TYPES)
def test_runner_decode_through_the_own_step_is_exact(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_random_model(model_type, max_positions=512)
    taken = []
    real = hf_decode_step.decode_hidden
    monkeypatch.setattr(hf_decode_step, "decode_hidden", lambda *args: taken.append(1) or real(*args))
    runner = PrefixCachingRunner(model, cache_tokens=1024, block_size=16)
    prompt = torch.randint(1, 300, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    runner.prefill(prompt[:30])
    tokens = list(runner.generate(prompt, SamplingParams(max_new_tokens=10)).token_ids)
    assert len(taken) == 9  # every step after the prefill's token
    reference = model.forward_reference(
        torch.tensor(prompt + tokens[:-1]), return_logits=True, logits_from=len(prompt) - 1
    )
    assert reference.argmax(-1).tolist() == tokens


def test_batched_rows_of_different_lengths_stay_equal_to_serial() -> None:
    # A padded batch carries an attention mask: it goes through the model, and the own step serves the rows alone.
    model = tiny_random_model("qwen2", max_positions=512)
    runner = PrefixCachingRunner(model, cache_tokens=2048, block_size=16)
    prompts = [torch.randint(1, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 45)]
    params = SamplingParams(max_new_tokens=8)
    together = [list(r.token_ids) for r in runner.generate_many(prompts, params)]
    alone = [list(PrefixCachingRunner(model, cache_tokens=2048).generate(p, params).token_ids) for p in prompts]
    assert together == alone


def test_a_sliding_window_another_attention_or_another_type_is_left_to_the_model() -> None:
    llama = tiny_random_model("llama")
    assert decode_layers(llama.model.model, llama.config) is not None
    llama.config._attn_implementation = "eager"
    assert decode_layers(llama.model.model, llama.config) is None
    gpt2 = tiny_random_model("gpt2")
    assert decode_layers(gpt2.model.transformer, gpt2.config) is None
    windowed = tiny_random_model("mistral", max_positions=256)
    assert windowed.config.sliding_window >= 256  # Mistral's default window: longer than any context here
    assert decode_layers(windowed.model.model, windowed.config) is not None
    windowed.config.sliding_window = 8
    assert decode_layers(windowed.model.model, windowed.config) is None
    qwen = tiny_random_model("qwen2")
    qwen.config.layer_types = ["sliding_attention", "full_attention"]
    assert decode_layers(qwen.model.model, qwen.config) is None


@pytest.mark.parametrize("where", ["base", "layer", "attention"])
def test_a_hook_on_a_module_the_own_step_skips_keeps_the_models_path(where: str) -> None:
    model = tiny_random_model("llama", max_positions=256)
    base = model.model.model
    module = {"base": base, "layer": base.layers[1], "attention": base.layers[1].self_attn}[where]
    calls = []
    handle = module.register_forward_hook(lambda *args: calls.append(1))
    try:
        assert decode_layers(base, model.config) is None
        _step_logits(model, list(range(1, 20)), 5)
        assert len(calls) == 2  # the prefill and the decode step both ran the hooked module
    finally:
        handle.remove()
    assert decode_layers(base, model.config) is not None


def test_a_decoder_layer_class_of_the_users_own_keeps_the_models_path() -> None:
    model = tiny_random_model("qwen2")
    base = model.model.model
    layer = base.layers[0]
    layer.__class__ = type("PatchedLayer", (type(layer),), {"__module__": "user_code"})
    assert decode_layers(base, model.config) is None


def test_a_global_module_hook_keeps_the_models_path() -> None:
    # torch's global hooks fire on every module's forward, the decoder layers' too: those must not be skipped.
    model = tiny_random_model("llama")
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert decode_layers(model.model.model, model.config) is None
    finally:
        handle.remove()
    assert decode_layers(model.model.model, model.config) is not None


def _scaled_attention_output(forward, wraps: bool = False):
    def patched(self, *args, **kwargs):
        out, weights = forward(self, *args, **kwargs)
        return out * 1.5, weights

    # functools.wraps copies the original's __module__ and sets __wrapped__, as most patching decorators do.
    return functools.wraps(forward)(patched) if wraps else patched


@pytest.mark.parametrize("where", ["instance", "class", "class, functools.wraps"])
def test_a_replaced_attention_forward_keeps_the_models_path(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Patching libraries replace a class's forward, users an instance's: decode must compute what the patch does.
    model = tiny_random_model("llama", max_positions=256)
    attention = model.model.model.layers[1].self_attn
    if where.startswith("class"):
        wrapped = _scaled_attention_output(type(attention).forward, wraps=where.endswith("wraps"))
        monkeypatch.setattr(type(attention), "forward", wrapped)
    else:
        monkeypatch.setattr(
            attention,
            "forward",
            lambda *a, **k: _scaled_attention_output(type(attention).forward)(attention, *a, **k),
            raising=False,
        )
    assert decode_layers(model.model.model, model.config) is None
    prompt = list(range(1, 30))
    logits, _ = _step_logits(model, prompt, 5)
    torch.testing.assert_close(logits, model.forward_reference(torch.tensor([*prompt, 5])), atol=1e-5, rtol=0)


def test_a_patched_rotary_function_is_the_one_the_own_step_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    model = tiny_random_model("llama", max_positions=256)
    modeling = sys.modules[type(model.model.model.layers[0].self_attn).__module__]
    real = modeling.apply_rotary_pos_emb
    calls = []

    def doubled(q, k, cos, sin, *args, **kwargs):
        calls.append(q.shape[2])
        return real(q, k, 2 * cos, sin, *args, **kwargs)

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", doubled)
    assert decode_layers(model.model.model, model.config) is not None
    prompt = list(range(1, 30))
    logits, _ = _step_logits(model, prompt, 5)
    assert calls[-2:] == [1, 1]  # the decode step's query, in both layers, through the patched function
    torch.testing.assert_close(logits, model.forward_reference(torch.tensor([*prompt, 5])), atol=1e-5, rtol=0)


def test_a_kernelized_rotary_function_keeps_the_models_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # kernels.kernelize gives an attention module's private rotary wrapper a forward of its own; only the attention's
    # own forward calls it, so the own step (which calls the modeling file's function) must decline.
    model = tiny_random_model("llama", max_positions=256)
    assert decode_layers(model.model.model, model.config) is not None

    class Wrapper(torch.nn.Module):
        pass

    wrapper = Wrapper()
    wrapper.forward = lambda q, k, cos, sin, *a, **kw: (q, k)
    attention = model.model.model.layers[0].self_attn
    monkeypatch.setitem(attention.__dict__, "_kernel_funcs", {"rotary_pos_emb": wrapper})
    assert decode_layers(model.model.model, model.config) is None


def test_the_stock_forward_check_follows_wrappers_to_their_code() -> None:
    from prefixcache.models.hf_decode_step import _stock_forward

    stock = type(tiny_random_model("llama", max_positions=256).model.model.layers[0].self_attn).forward
    assert _stock_forward(stock)
    assert not _stock_forward(functools.wraps(stock)(lambda *a, **k: stock(*a, **k)))
    assert not _stock_forward(len)  # not a Python function at all
