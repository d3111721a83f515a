"""A runner built the same way in a test's process and in an engine process (:func:`tiny_runner`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tiny_runner"]


def tiny_runner(cache_tokens: int = 4096, block_size: int = 16, torch_threads: int | None = 1) -> Any:
    """A :class:`~prefixcache.engine.runner.PrefixCachingRunner` over the embedded ``tiny`` model on the CPU with a
    pool of ``cache_tokens``: module-level, so that an engine process
    (:class:`~prefixcache.engine.process.EngineProcess`, ``functools.partial(tiny_runner, ...)``) builds the same
    runner a test builds in-process.  ``torch_threads`` (default 1, as in the tests' own process) is set first: a
    second intra-op thread on a small machine only spin-waits."""
    from prefixcache.engine.runner import PrefixCachingRunner
    from prefixcache.models.llama import build_model

    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    return PrefixCachingRunner(build_model("tiny", device="cpu"), cache_tokens=cache_tokens, block_size=block_size)
