"""The engine: drives a model through the cache, prefilling only each request's uncached suffix, then decoding.

One request path, its modules in the order a request meets them: ``checks`` (validate, fingerprint the namespace),
``request`` (the engine's record and the caller's handle), ``scheduler`` (admission order) and ``preemption``,
``core`` (the engine core: batched prefill and decode, stopping, the result), ``logits`` (picking each token from
``sampling``'s parameters), ``results`` (usage and result records).  Front ends: ``runner`` (the cache, pool and
serial calls), ``batching`` (the threaded continuous-batching service), ``chat`` (templates, stop strings, tool calls),
with ``chat_decoder`` (tokens to answer text) and ``tool_choice`` (the forced start of a call).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixcache.engine.results import ChatResult, GenerationResult, TokenLogprob, Usage
    from prefixcache.engine.runner import PrefixCachingRunner
    from prefixcache.engine.sampling import SamplingParams

__all__ = ["ChatResult", "GenerationResult", "PrefixCachingRunner", "SamplingParams", "TokenLogprob", "Usage"]

_LAZY = {
    **dict.fromkeys(("ChatResult", "GenerationResult", "TokenLogprob", "Usage"), "prefixcache.engine.results"),
    "PrefixCachingRunner": "prefixcache.engine.runner",
    "SamplingParams": "prefixcache.engine.sampling",
}
"""Names imported on first use (:pep:`562`), so that a module of this folder that needs no torch (``draft``) imports
none."""


def __getattr__(name: str) -> Any:
    """A lazy name of the engine, imported on first use (and kept); AttributeError for any other name."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
