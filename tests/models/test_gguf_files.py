"""GGUF files made here with the ``gguf`` package's own writer (a 2-layer Llama with a byte-level vocabulary): what
loads, what is served exactly, and what is refused in one line — a missing weight (which transformers would leave
random), a tensor of the wrong shape, a suffix transformers does not read as GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.errors import InvalidArgumentError, UnsupportedModelError
from prefixcache.testing import require_extra

gguf = require_extra("gguf", "hf")
np = pytest.importorskip("numpy")

from prefixcache import PrefixCachingRunner  # noqa: E402
from prefixcache.models.loading import load_model  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DIM, HEADS, KV_HEADS, FF, LAYERS = 64, 4, 2, 128, 2


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character table, the token strings of a byte-level vocabulary."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


def write_gguf(path: Path, *, drop: str | None = None, reshape: dict[str, tuple[int, ...]] | None = None) -> Path:
    """A 2-layer Llama GGUF of random F32 weights with a tokenizer and ChatML template; ``drop`` leaves a tensor out,
    ``reshape`` gives tensors other shapes."""
    tokens = [*byte_alphabet(), "<|im_start|>", "<|im_end|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(DIM // HEADS)
    vocab = len(tokens) + 6  # rows to spare: transformers' conversion may add a token (an unknown one)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    kv = KV_HEADS * DIM // HEADS
    shapes = {
        "token_embd.weight": (vocab, DIM),
        "output_norm.weight": (DIM,),
        "output.weight": (vocab, DIM),
    }
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (DIM,),
            f"blk.{i}.ffn_norm.weight": (DIM,),
            f"blk.{i}.attn_q.weight": (DIM, DIM),
            f"blk.{i}.attn_k.weight": (kv, DIM),
            f"blk.{i}.attn_v.weight": (kv, DIM),
            f"blk.{i}.attn_output.weight": (DIM, DIM),
            f"blk.{i}.ffn_gate.weight": (FF, DIM),
            f"blk.{i}.ffn_up.weight": (FF, DIM),
            f"blk.{i}.ffn_down.weight": (DIM, FF),
        }
    shapes |= reshape or {}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name != drop:
            values = np.ones(shape) if len(shape) == 1 else rng.standard_normal(shape) * 0.2
            writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_written_gguf_is_served_with_its_own_tokenizer_and_cached_equals_uncached(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "mini.gguf")
    runner = PrefixCachingRunner.from_model(str(path), cache_tokens=1024)
    assert 258 <= runner.tokenizer.vocab_size <= runner.model.vocab_size == 264
    ask = [{"role": "user", "content": "hello there"}]
    cold = runner.chat(ask, max_new_tokens=6)
    warm = runner.chat(ask, max_new_tokens=6)
    assert warm.usage.cached_tokens == warm.usage.prompt_tokens - 1
    assert warm.token_ids == cold.token_ids
    fresh = PrefixCachingRunner.from_model(str(path), cache_tokens=1024).chat(ask, max_new_tokens=6)
    assert fresh.token_ids == cold.token_ids


def test_a_missing_weight_is_refused_naming_it(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "holed.gguf", drop="blk.1.ffn_up.weight")
    with pytest.raises(UnsupportedModelError, match=r"lacks weights .*layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(path))


def test_a_file_without_an_lm_head_ties_it_to_the_embedding(tmp_path: Path) -> None:
    model = load_model(str(write_gguf(tmp_path / "tied.gguf", drop="output.weight")))
    assert model.model.lm_head.weight.data_ptr() == model.model.model.embed_tokens.weight.data_ptr()


def test_a_tensor_of_the_wrong_shape_is_one_error_naming_the_file(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bent.gguf", reshape={"blk.0.attn_q.weight": (48, DIM)})
    with pytest.raises(UnsupportedModelError, match=r"bent\.gguf: its tensors do not fit its architecture"):
        load_model(str(path))


def test_an_upper_case_suffix_is_refused_with_the_rename_it_needs(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "LOUD.GGUF")
    with pytest.raises(InvalidArgumentError, match=r"rename it to end in \.gguf"):
        load_model(str(path))
