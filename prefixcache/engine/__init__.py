"""The engine: drives a model through the cache, one request end to end (prefill only the uncached suffix, then
decode), and picks tokens."""

from prefixcache.engine.runner import ChatResult, GenerationResult, PrefixCachingRunner, Usage
from prefixcache.engine.sampling import SamplingParams

__all__ = ["ChatResult", "GenerationResult", "PrefixCachingRunner", "SamplingParams", "Usage"]
