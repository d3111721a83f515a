"""The Hugging Face architectures prefixcache serves exactly, by the kind of layers they have: the support table.

:data:`ARCHITECTURES` names every ``config.model_type`` whose exactness ``tests/models/test_architectures.py`` checks
(:data:`~prefixcache.models.hf_support.TESTED_MODEL_TYPES` is read from it; other types load with a warning), and
:data:`LAYER_KINDS` says, per kind of layer, what the pool holds for each token and what is kept beside it.  Pure
data, no imports: the README's architectures table is rendered from it (``python -m prefixcache.cli.reference``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCHITECTURES", "LAYER_KINDS", "Architecture", "LayerKind"]


@dataclass(frozen=True, slots=True)
class LayerKind:
    """One kind of layer: ``title`` as the table shows it, what the pool holds per token (``pool_holds``) and what is
    kept beside the pool (``also_kept``, empty when nothing)."""

    title: str
    pool_holds: str
    also_kept: str = ""


@dataclass(frozen=True, slots=True)
class Architecture:
    """A served architecture: its ``config.model_type``, the ``name`` users know it by, its ``kind``, a key of
    :data:`LAYER_KINDS`, and a ``note`` on what sets it apart within that kind (empty when nothing)."""

    model_type: str
    name: str
    kind: str
    note: str = ""


LAYER_KINDS: dict[str, LayerKind] = {
    "full": LayerKind("full attention", "K and V of every layer"),
    "windowed": LayerKind(
        "sliding-window, chunked",
        "K and V of every layer, sliding ones whole: nothing outside the window is freed (bf16: Gemma 3 27B 508 KB a "
        "token against 82 KB + 416 MiB a live path for a window-freeing cache; gpt-oss-20b 49 KB against 25 KB + "
        "3 MiB)",
    ),
    "latent": LayerKind(
        "latent attention",
        "the latent (as K) and the rotary key (as V), packed into one `head_dim` (V3: 70,272 bytes a token in bf16)",
    ),
    "recurrent": LayerKind(
        "linear attention or SSM, beside attention or alone",
        "K and V of the attention layers only (Mamba-2: a one-element placeholder)",
        "a snapshot of every recurrent layer's state at the end of every prompt and answer, before a prompt's last "
        "token, every 16 blocks of a prompt and where requests part ways inside a cached prompt, under its own byte "
        "budget (default a quarter of the pool; the states resumed most, deepest and latest kept)",
    ),
}

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("llama", "Llama", "full"),
    Architecture("qwen2", "Qwen2", "full"),
    Architecture("qwen3", "Qwen3", "full"),
    Architecture("qwen3_moe", "Qwen3-MoE", "full"),
    Architecture("gemma", "Gemma", "full"),
    Architecture("glm4_moe", "GLM-4-MoE", "full"),
    Architecture("phi3", "Phi-3", "full"),
    Architecture("olmo2", "OLMo2", "full"),
    Architecture("gpt2", "GPT-2", "full"),
    Architecture("mistral", "Mistral", "windowed", "with a sliding window; without one, full attention"),
    Architecture("gemma2", "Gemma 2", "windowed"),
    Architecture("gemma3_text", "Gemma 3", "windowed"),
    Architecture("gpt_oss", "gpt-oss", "windowed", "attention sinks"),
    Architecture("cohere2", "Cohere2", "windowed"),
    Architecture("exaone4", "EXAONE 4", "windowed"),
    Architecture("llama4_text", "Llama 4", "windowed", "chunked attention"),
    Architecture("deepseek_v2", "DeepSeek-V2", "latent"),
    Architecture("deepseek_v3", "DeepSeek-V3", "latent"),
    Architecture("qwen3_next", "Qwen3-Next", "recurrent"),
    Architecture("nemotron_h", "Nemotron-H", "recurrent"),
    Architecture("granitemoehybrid", "Granite-4.0-H", "recurrent"),
    Architecture("minimax", "MiniMax", "recurrent"),
    Architecture("mamba2", "Mamba-2", "recurrent"),
)
"""Every tested architecture, grouped by kind in :data:`LAYER_KINDS` order."""
