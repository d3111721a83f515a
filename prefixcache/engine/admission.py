"""Admission of one waiting request: its prefix match, lease and reservation, and the bookkeeping it starts with.

The engine core (:class:`~prefixcache.engine.core.EngineCore`) decides which waiting request to try next
(:mod:`prefixcache.engine.scheduler` orders them) and whether it runs; :func:`admit` takes what the request needs
from the cache.  A first admission matches the prompt, at most ``len - 1`` tokens of it (the last prompt token is
always computed: its logits start decoding); a resumption (after a preemption) matches every token it knows, less
the prompt rows it still owes, and starts again where the cache lets it.
"""

from __future__ import annotations

import torch

from prefixcache.cache.radix_cache import RadixCache
from prefixcache.engine.logits import LogitsPipeline
from prefixcache.engine.request import EngineRequest
from prefixcache.errors import OutOfBlocksError

__all__ = ["admit"]


def admit(
    request: EngineRequest,
    cache: RadixCache,
    *,
    device: torch.device,
    vocab_size: int,
    recurrent: bool,
    can_wait: bool,
) -> bool:
    """Acquire ``request``'s lease and reserve blocks for every token it knows; True once it may run.

    On success ``request.position`` is the number of tokens whose K/V the lease already holds (its prefill starts
    there); a first admission also records its cache figures (cached, copied, host-cached and, for a ``recurrent``
    model, matched but not resumable tokens) and gets its :class:`LogitsPipeline` (on ``device``, ``vocab_size``
    wide), which it keeps across preemptions.  False, nothing taken, when the pool is short and ``can_wait`` (running
    requests hold the pool: the request waits for them).  Raises what the cache raised (OutOfBlocksError when it
    cannot wait, PoolBusyError, CapacityError, ...) with the lease released.  O(prompt) for the match.
    """
    # A first admission matches the prompt (never into forced tokens); a resumption all it knows, except that one
    # owing prompt logits matches no further than its first missing row: what others cached meanwhile must not
    # skip rows it has not returned yet.
    tokens = request.prompt_array if request.preemptions == 0 else request.known_tokens()
    match = tokens
    if request.preemptions and request.wants_prompt_rows and request.logits_until < len(request.prompt):
        match = tokens[: request.logits_until + 1]
    elif request.preemptions == 0 and request.recompute_prompt:
        match = tokens[:1]  # a match ends one short of the tokens: nothing cached is used
    try:
        request.lease = cache.acquire(
            match,
            request.namespace,
            request_id=request.request_id,
            num_tokens=len(tokens),
            resumed=request.preemptions > 0,
        )
        cache.reserve(request.lease, len(tokens))
    except Exception as error:
        if request.lease is not None and not request.lease.closed:
            cache.release(request.lease)
        request.lease = None
        if can_wait and isinstance(error, OutOfBlocksError):
            return False
        raise
    request.position = request.lease.num_cached_tokens
    if recurrent:
        request.live.start_state = request.lease.resume_state
    if request.preemptions == 0:
        request.cached, request.copied = request.position, request.lease.num_copied_tokens
        request.unresumed = request.lease.num_matched_tokens - request.position if recurrent else 0
        request.host_cached = request.lease.num_host_tokens
        request.logits_until = request.position  # the rows start at the first prefilled position, resumed or not
        request.live.capacity = len(request.prompt) + request.num_new_tokens()
        request.picker = LogitsPipeline(request.sampling, device, vocab_size, request.prompt_array)
    return True
