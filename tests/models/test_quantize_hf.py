"""Specification of weight-only quantization of Hugging Face models (``HFCausalLM.quantize``) on tiny random ones: every
``nn.Linear`` is replaced (biases kept), an embedding of its own or of a class of its own stays dense, the fingerprint
moves, and the logits after a cached prefix equal the unsplit forward's within bfloat16 steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.errors import InvalidArgumentError
from prefixcache.testing import require_extra

require_extra("transformers", "hf")

from prefixcache.models.hf_tiny import tiny_random_model  # noqa: E402
from prefixcache.models.quantize import QuantizedLinear  # noqa: E402

LOGIT_TOL = 0.0625  # logits of magnitude 4-8 out of a bfloat16 product: 0.03125 apart (measured: 0)


@pytest.mark.parametrize(("model_type", "mode"), [("qwen2", "int8"), ("qwen2", "int4"), ("gemma2", "int4")])
def test_every_linear_layer_is_replaced_and_cached_logits_stay_within_the_bound(model_type: str, mode: str) -> None:
    """Qwen2 (Q/K/V with biases, its own embedding) and Gemma 2 (an LM head tied to a scaled embedding class, which
    stays dense: the head is quantized beside it)."""
    model = tiny_random_model(model_type, vocab_size=320)
    dense_print = model.fingerprint()
    summary = model.quantize(mode)
    hf = model.model
    assert not [name for name, module in hf.named_modules() if type(module) is nn.Linear]
    assert len(summary.quantized) == 2 * 7 + 1 and summary.head_mode == "int8"
    assert isinstance(hf.get_output_embeddings(), QuantizedLinear)
    assert type(hf.get_input_embeddings()).__name__ in ("Embedding", "Gemma2TextScaledWordEmbedding")
    if model_type == "qwen2":
        assert isinstance(hf.model.layers[0].self_attn.q_proj.bias, nn.Parameter)
    assert model.fingerprint() != dense_print
    ids = list(range(1, 60))
    runner = PrefixCachingRunner(model, cache_tokens=512)
    runner.generate(ids[:40], SamplingParams(max_new_tokens=2))
    result = runner.generate(ids, SamplingParams(max_new_tokens=4), return_logits=True)
    reference = model.forward_reference(torch.tensor(ids), return_logits=True, logits_from=40)
    assert result.usage.cached_tokens == 40
    assert float((result.prompt_logits - reference).abs().max()) <= LOGIT_TOL
    with pytest.raises(InvalidArgumentError, match="already quantized"):
        model.quantize(mode)
