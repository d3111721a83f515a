"""What the engine writes into the radix tree for a request: its prompt once prefilled, a recurrent model's state
snapshots, and its computed tokens when it finishes or is preempted.

With ``policy="lpm"`` a request's prompt goes into the tree as soon as its prefill ends
(:meth:`RadixCache.insert_prefix`), not when it finishes: requests admitted while it decodes hit it.  A recurrent
model's state is kept (a copy, :meth:`CausalLM.take_state`) at the end of every prompt and every answer, before a
prompt's last token (a repeated prompt recomputes that one), every ``state_interval`` tokens of a prompt and at the
branch marks the cache hands the request (:mod:`prefixcache.cache.marks`); requests resume only there
(:mod:`prefixcache.cache.resume`).
"""

from __future__ import annotations

import logging
from typing import Any

from prefixcache.cache.radix_cache import InsertResult, RadixCache
from prefixcache.engine.request import EngineRequest
from prefixcache.models.base import CausalLM

__all__ = ["TreeWrites"]

logger = logging.getLogger(__name__)


class TreeWrites:
    """A request's writes into ``cache``, with ``model``'s state where it is ``recurrent`` (``state_interval``:
    tokens between the state points inside a prompt, 0: none).  Each write raises what the cache raised (the engine
    then fails the request, which releases its lease: nothing it half-wrote is cached)."""

    def __init__(self, model: CausalLM, cache: RadixCache, *, recurrent: bool, state_interval: int) -> None:
        self.model = model
        self.cache = cache
        self.recurrent = recurrent
        self.state_interval = state_interval

    def state_at(self, request: EngineRequest) -> Any:
        """A recurrent model's state after ``request.position`` tokens, for the cache to keep (a copy), else None:
        the model has no recurrent layers, or the request's live state stands elsewhere."""
        live = request.live
        if not self.recurrent or live.data is None or live.num_tokens != request.position:
            return None
        return self.model.take_state(live)

    def insert_prompt(self, request: EngineRequest) -> None:
        """Put ``request``'s prompt into the tree while it goes on (its blocks then shared with the tree), with the
        state kept before its last token, if any.  O(prompt)."""
        self.cache.insert_prefix(request.lease, request.prompt_array, state=self.state_at(request))
        request.table = None  # the insert may have rewritten the lease's table in place (blocks shared with the tree)
        request.prompt_inserted = True
        pending, request.pending_state = request.pending_state, None
        if pending is not None:
            self.cache.put_state(request.lease, len(request.prompt) - 1, pending)

    def keep_inner_state(self, request: EngineRequest) -> None:
        """A recurrent model's prefill stopped inside the prompt: keep the state there.  At a multiple of
        ``state_interval`` (a block boundary) the tree takes the prompt so far with it at once; the state before the
        prompt's last token waits for the whole prompt's insert (:meth:`insert_prompt`), as its block is the one
        the request goes on writing."""
        position = request.position
        if position == len(request.prompt) - 1:
            request.pending_state = self.state_at(request)
            return
        if not self.state_interval or position % self.state_interval:
            state = self.state_at(request) if position in request.lease.state_points else None
            if state is not None:
                # A branch point the tree holds already (another request's tokens): only the state is new there.
                self.cache.put_state(request.lease, position, state)
            return
        self.cache.insert_prefix(request.lease, request.prompt_array[:position], state=self.state_at(request))
        request.table = None  # the insert rewrote the lease's table in place

    def commit_finished(self, request: EngineRequest) -> InsertResult:
        """Commit ``request``'s computed tokens into the tree (its lease closes) and apply its retention; what the
        insert did.  The state before the prompt's last token, still pending, goes in with the prompt first."""
        if request.pending_state is not None and not request.prompt_inserted:
            self.insert_prompt(request)
        insert = self.cache.commit(
            request.lease, request.known_tokens()[: request.position], state=self.state_at(request)
        )
        if request.retention is not None:
            priority, retain_s = request.retention
            self.cache.retain(request.prompt_array, request.namespace, priority=priority, retain_s=retain_s)
        return insert

    def commit_preempted(self, request: EngineRequest) -> None:
        """Cache the tokens a preempted ``request`` has computed and close its lease.  Never raises for the cache:
        the tokens are only a hit to come, so on failure the lease is released and they are recomputed."""
        try:
            if request.position:
                self.cache.commit(
                    request.lease, request.known_tokens()[: request.position], state=self.state_at(request)
                )
            else:
                self.cache.release(request.lease)
        except Exception:  # noqa: BLE001 - the tokens are only a cache hit to come: recompute them instead
            logger.exception("caching a preempted request's tokens failed; it will recompute them")
            if not request.lease.closed:
                self.cache.release(request.lease)
