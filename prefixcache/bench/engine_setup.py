"""The sizes and inputs of ``bench engine``: a run's setup (full or quick), the HF model under test, random prompts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.errors import InvalidArgumentError, install_command

__all__ = ["BLOCK_SIZE", "FULL", "QUICK", "QWEN_DIR", "EngineSetup", "build_bench_model", "random_ids", "setup_dict"]

QWEN_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tokenizers" / "qwen2.5-0.5b-instruct"
"""The Qwen2.5-0.5B-Instruct tokenizer and config folder beside the repository."""

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """Sizes of one run: model layers, prompt lengths (tokens) for TTFT and decode, decode steps, repeats, the
    batching case (embedded preset, sessions, system prompt and question tokens, tokens generated per session), and
    the interleaved repeats of the cold TTFT (one count per TTFT length: the short prompt's ratio scatters most and
    costs least) and batching cases, whose ratios scatter most on a shared machine."""

    layers: int
    ttft_lengths: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int
    repeats: int
    quick: bool
    batch_preset: str = "small"
    batch_sessions: int = 8
    batch_system_tokens: int = 2000
    batch_question_tokens: int = 32
    batch_new_tokens: int = 32
    cold_repeats: tuple[int, ...] = (2, 2)
    batch_repeats: int = 2
    hybrid_tokens: int = 2048


FULL = EngineSetup(
    layers=4,
    ttft_lengths=(1024, 4096),
    decode_contexts=(2048, 8192),
    decode_steps=16,
    repeats=2,
    quick=False,
    cold_repeats=(12, 6),
    batch_repeats=3,
)
QUICK = EngineSetup(
    layers=2,
    ttft_lengths=(128, 256),
    decode_contexts=(256,),
    decode_steps=8,
    repeats=2,
    quick=True,
    batch_preset="tiny",
    batch_system_tokens=200,
    batch_new_tokens=8,
    hybrid_tokens=256,
)


def setup_dict(setup: EngineSetup) -> dict:
    """``setup``'s fields by name, for the JSON report."""
    return {name: getattr(setup, name) for name in EngineSetup.__slots__}


def build_bench_model(quick: bool, layers: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """The HF model under test on ``device`` in ``dtype``: the shared Qwen2.5-0.5B config cut to ``layers`` layers,
    or (``quick``) a tiny Qwen2.

    Raises InvalidArgumentError when transformers (extra ``hf``) is missing or the shared config is absent.
    """
    try:
        import transformers  # noqa: F401 - only to say which extra is missing
    except ImportError:
        raise InvalidArgumentError(f"this benchmark needs transformers: {install_command('hf')}") from None
    from prefixcache.models.hf import random_model_from_config
    from prefixcache.models.hf_tiny import tiny_random_model

    if not quick:
        if not (QWEN_DIR / "config.json").is_file():
            raise InvalidArgumentError(f"the Qwen config is missing at {QWEN_DIR}; run with --quick or fetch ../shared")
        return random_model_from_config(QWEN_DIR, layers=layers, seed=0, dtype=dtype, device=device)
    model = tiny_random_model("qwen2", vocab_size=2048, layers=layers, max_positions=4096, device=device)
    model.model.to(dtype)
    return model


def random_ids(vocab: int, n: int, seed: int) -> list[int]:
    """``n`` token ids drawn uniformly below ``vocab`` by a generator seeded with ``seed`` (global RNG untouched)."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
