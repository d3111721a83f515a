"""Models prefix caching can drive: the :class:`CausalLM` protocol and the embedded seeded Llama."""

from prefixcache.models.base import (
    BatchRow,
    CausalLM,
    LiveKV,
    ModelConfig,
    check_cached_call,
    check_live,
    check_reference_call,
    config_fingerprint,
    forward_batch,
    kv_pool_shape,
    num_blocks_for,
)
from prefixcache.models.llama import ARCHITECTURE, PRESETS, LlamaModel, build_model

__all__ = [
    "ARCHITECTURE",
    "BatchRow",
    "PRESETS",
    "CausalLM",
    "LiveKV",
    "LlamaModel",
    "ModelConfig",
    "build_model",
    "check_cached_call",
    "check_live",
    "check_reference_call",
    "config_fingerprint",
    "forward_batch",
    "kv_pool_shape",
    "num_blocks_for",
]
