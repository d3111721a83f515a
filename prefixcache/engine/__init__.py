"""The engine: drives a model through the cache, prefilling only each request's uncached suffix, then decoding.

One request path, its modules in the order a request meets them: ``checks`` (validate, fingerprint the namespace),
``request`` (the engine's record and the caller's handle), ``scheduler`` (admission order) and ``preemption``,
``core`` (the engine core: batched prefill and decode, stopping, the result), ``logits`` (picking each token from
``sampling``'s parameters), ``results`` (usage and result records).  Front ends: ``runner`` (the cache, pool and
serial calls), ``batching`` (the threaded continuous-batching service), ``chat`` (templates, stop strings, tool calls).
"""

from prefixcache.engine.results import ChatResult, GenerationResult, TokenLogprob, Usage
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams

__all__ = ["ChatResult", "GenerationResult", "PrefixCachingRunner", "SamplingParams", "TokenLogprob", "Usage"]
