"""The plan of one engine step: which running requests compute which of their tokens in the step's batched forward.

Decode rows come first, one token each, and with speculation a draft after it (:mod:`prefixcache.engine.speculation`)
from what the budget leaves once every decode row has its token; then chunks of prompts and of forced answers, in
admission order, under the step's token budget (chunked prefill, as in Sarathi and vLLM's ``max_num_batched_tokens``;
vLLM's scheduler too counts a running request's draft tokens before new prompts' chunks).  A recurrent model's
prompt chunks end at its state points (:meth:`BatchPlanner.next_state_point`), where the engine keeps its state.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from prefixcache.cache.pool import KVBlockPool
from prefixcache.engine.request import EngineRequest
from prefixcache.models.base import BatchRow, CausalLM

__all__ = ["BatchPlanner", "Draft", "Grow"]

Grow = Callable[[EngineRequest, int, list[EngineRequest]], bool]
"""``grow(request, end, members)``: make ``request``'s lease hold ``end`` tokens (preempting running requests not in
``members``, this step's batch so far, while the pool is short); False when ``request`` cannot run this step (it was
preempted itself, or failed)."""

Draft = Callable[[EngineRequest, int], tuple[int, ...]]
"""``draft(request, max_tokens)``: the draft tokens a decoding ``request`` verifies after its next token this step (at
most ``max_tokens``, blocks for them reserved; empty: none)."""


class BatchPlanner:
    """Builds the :class:`~prefixcache.models.base.BatchRow` of each request that computes tokens this step, over
    ``model`` (its device, read at each use) and ``pool`` (the block tables).  ``state_interval`` (tokens, 0: never)
    is a recurrent model's spacing of the state points inside a prompt; ``recurrent`` whether the model has such
    layers."""

    def __init__(self, model: CausalLM, pool: KVBlockPool, *, recurrent: bool, state_interval: int) -> None:
        self.model = model
        self.pool = pool
        self.recurrent = recurrent
        self.state_interval = state_interval

    def plan(
        self, running: list[EngineRequest], max_batch_tokens: int | None, grow: Grow, draft: Draft | None = None
    ) -> tuple[list[BatchRow], list[EngineRequest]]:
        """The rows of this step and their requests, in the same order.  ``running`` is in admission order (``grow``
        may remove preempted requests from it); ``max_batch_tokens`` bounds the tokens of all rows (None: no bound).
        A request awaiting its caller's verdict on its last token computes nothing.  With ``draft``, a decoding
        request's row is its next token and the draft, and asks for the logits of every position.  O(running
        requests) plus the rows' token copies."""
        budget = max_batch_tokens if max_batch_tokens is not None else float("inf")
        rows, members = [], []
        # A forced answer is computed as a prompt is, in chunks: it takes what the decode rows leave of the budget,
        # else one long answer admitted first would hold back every decode row for many steps.
        decoding = [r for r in running if r.forced is None and r.position >= len(r.prompt)]
        chunked = [r for r in running if r.forced is not None or r.position < len(r.prompt)]
        for index, request in enumerate(decoding + chunked):
            if budget <= 0:
                break
            if request.awaiting_verdict or request not in running:
                continue  # its caller has not decided yet; or preempted to make room for one before it
            known = request.sequence_length()
            if request.forced is not None and request.position < len(request.prompt):
                known = len(request.prompt)  # the prompt in one pass, its forced answer in the next (as served alone)
            end = int(min(known, request.position + budget))
            if self.recurrent and request.position < len(request.prompt):
                end = min(end, self.next_state_point(request))
            if end > request.lease.capacity_tokens and not grow(request, end, members):
                continue
            drafted: tuple[int, ...] = ()
            if draft is not None and index < len(decoding) and end == known == request.position + 1:
                spare = budget - 1 - (len(decoding) - index - 1)  # one token for each decode row after this one
                if spare > 0:
                    drafted = draft(request, int(min(spare, 1 << 20)))  # no bound: inf
            table = self.block_table(request)  # after the draft's blocks were reserved
            if drafted:
                ids = torch.tensor([request.answer[-1], *drafted], dtype=torch.long, device=self.model.device)
                rows.append(BatchRow(ids, request.position, table, request.live, True))
            else:
                token_ids = self.token_ids(request, request.position, end)
                wants_logits = request.wants_prompt_rows and request.position < len(request.prompt)
                rows.append(BatchRow(token_ids, request.position, table, request.live, wants_logits))
            members.append(request)
            budget -= end - request.position + len(drafted)
        return rows, members

    def next_state_point(self, request: EngineRequest) -> int:
        """The first position after ``request.position`` where a recurrent model's prefill stops to keep its state:
        the next multiple of ``state_interval`` inside the prompt or branch mark the cache named
        (:attr:`Lease.state_points <prefixcache.cache.lease.Lease>`), else the position before the prompt's last token,
        else the prompt's end."""
        prompt_length = len(request.prompt)
        stops = [prompt_length, *request.lease.state_points]
        if request.position < prompt_length - 1:
            stops.append(prompt_length - 1)
        if self.state_interval:
            stops.append((request.position // self.state_interval + 1) * self.state_interval)
        return min(stop for stop in stops if stop > request.position)

    def block_table(self, request: EngineRequest) -> torch.Tensor:
        """The lease's block table on the device, made again only when the lease's table changed: a reserve makes a
        new array, an insert of the prompt rewrites it in place (and drops the tensor: ``request.table = None``)."""
        source = request.lease.block_table
        if request.table is None or request.table_source is not source:
            request.table = self.pool.block_table_tensor(source)
            request.table_source = source
        return request.table

    def token_ids(self, request: EngineRequest, start: int, end: int) -> torch.Tensor:
        """Known tokens ``start .. end - 1`` of ``request`` as int64 on the model's device (a prompt slice without a
        Python loop: prompts run to tens of thousands of tokens)."""
        prompt_length = len(request.prompt)
        if start >= prompt_length:  # a decode step: one token, no numpy round trip
            answer = request.answer[start - prompt_length : end - prompt_length]
            return torch.tensor(answer, dtype=torch.long, device=self.model.device)
        ids = np.frombuffer(request.prompt_array, dtype=np.uint32)[start : min(end, prompt_length)].astype(np.int64)
        if end > prompt_length:  # a resumed request recomputes its prompt and answer in one chunk
            answer = np.asarray(request.answer[: end - prompt_length], dtype=np.int64)
            ids = np.concatenate([ids, answer])
        return torch.from_numpy(ids).to(self.model.device)
