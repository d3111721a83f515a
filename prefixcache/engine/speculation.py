"""Speculative decoding in the engine core: which rows speculate, where their drafts come from, and how a verified
draft is accepted.

With ``speculate="tree"`` a decoding request may compute, in its row of the step's batched forward, its last generated
token followed by a draft of up to ``k`` tokens (a chunk of ``1 + k`` positions against its own K/V, beside the other
rows, under the step's token budget).  The logits of the ``1 + k`` positions are then read one at a time, exactly as
``1 + k`` decode steps would read them: the request's own pick from position ``i`` (its logits pipeline, in the state
the tokens accepted before it left: penalties, ``min_tokens``, grammar) is taken, goes through every per-token check
(logprobs, ``on_token``, stop tokens and strings, ``max_tokens``), and the next position is read only if that pick
equals draft token ``i`` and the request goes on.  So the longest prefix of the draft that agrees with the model is
accepted, plus the model's own token after it (the "bonus" token), and a token that ends the request drops what
follows it.  The K/V written for the rejected positions are discarded: the request's live K/V are cut back to the
tokens kept and the blocks reserved only for them go back to the pool (:meth:`RadixCache.shrink`); nothing of a
rejected token reaches the tree, the KV events or a callback.  (Leviathan et al. 2023 and Chen et al. 2023 for the
rule; with greedy picks it reduces to this prefix match, as in vLLM's and SGLang's n-gram speculation.)

Which rows speculate (:func:`speculates`): greedy requests only (``temperature == 0``), so their output is the same
tokens as without speculation (up to the float rounding of computing positions in one chunk rather than one by one,
as with chunked prefill); sampled requests decode one token a step as before (the speculative rejection rule that
keeps a sampled token's distribution is not implemented).  Not forced answers, not requests whose caller gives a
verdict after each token (the runner's serial ``stream``/``generate``, which yield one token at a time), and not the
prompt's first token.  A request with a grammar has its draft cut before the verify at the first token the grammar
forbids (:meth:`~prefixcache.engine.logits.LogitsPipeline.draft_prefix`).  Models with recurrent layers never
speculate: their state after a rejected token cannot be rolled back without a snapshot at every position.

Drafts come from a :class:`DraftSource`; the engine's is :class:`TreeDrafts`, the runner's
:class:`~prefixcache.engine.draft.Drafter` over the request's own context and the cache's blocks of its namespace.

Cost, measured on this project's 2-core development machine with one torch thread (others' jobs loading it, load
average 1-3): a verify of ``k`` draft tokens at 2,048 tokens of context, against one decode step, is 1.3-1.5x at
``k = 1`` and 2.1-3.0x at ``k = 8`` for the embedded ``small`` preset (12-16 ms a step), 1.9x and 5.2x for a
4-layer Qwen2.5-0.5B shape through transformers (42 ms a step; its 151,936-token LM head, computed at every verified
position, dominates).  On one CPU thread a forward of 9 rows is compute-bound where one row is memory-bound, so a
draft pays only when it is mostly accepted: the small preset decoded a repeated prompt's cached answer at 1.9-2x the
tokens per second (180 of 236 draft tokens accepted) and fresh answers at 1.1-1.2x; the agent benchmark's way (d)
matched way (c) (decode time per token (c)/(d) 1.00, 1.11 from step 3).  Hence ``"off"`` by default.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixcache.cache.radix_cache import RadixCache
from prefixcache.engine.draft import DEFAULT_MAX_DRAFT_TOKENS, Drafter, DraftLength, DraftSession
from prefixcache.engine.request import EngineRequest
from prefixcache.errors import InvalidArgumentError

__all__ = [
    "SPECULATE_MODES",
    "DraftSource",
    "TreeDrafts",
    "VerifyClock",
    "check_speculate",
    "draft_room",
    "speculates",
]

PROBE_EVERY_STEPS = 16
"""Steps a request's draft length controller may draft nothing before a short draft probes the acceptance again."""

PROBE_TOKENS = 2
"""The length of that probe."""

SPECULATE_MODES = ("off", "tree")
"""``"off"``: one token a decode step.  ``"tree"``: greedy rows verify drafts from their context and the cache."""


def check_speculate(mode: object) -> str:
    """``mode`` if it is one of :data:`SPECULATE_MODES`.  Raises InvalidArgumentError otherwise."""
    if mode not in SPECULATE_MODES:
        raise InvalidArgumentError(f"speculate must be one of {SPECULATE_MODES}, got {mode!r}")
    return mode  # type: ignore[return-value]


class DraftSource(Protocol):
    """Where an engine core's drafts come from.  Called on the thread that steps, between forwards."""

    def propose(self, request: EngineRequest, max_tokens: int) -> Sequence[int]:
        """Up to ``max_tokens`` (>= 1) token ids to follow ``request``'s known tokens (its prompt and
        ``generated``); empty: none this step.  May keep its own record in ``request.draft_state``."""
        ...

    def verified(self, request: EngineRequest, num_proposed: int, num_accepted: int) -> None:
        """A draft of ``num_proposed`` tokens (what the engine kept of a proposal: it may cut one short) was verified
        and its first ``num_accepted`` accepted."""
        ...

    # Optional: ``observe(num_draft_tokens, seconds)``, the time of a CPU forward of one decoding row with that many
    # draft tokens (the engine calls it where the source has it).


def speculates(request: EngineRequest) -> bool:
    """Whether ``request`` may verify a draft this step: greedy, not forced, no per-token verdict from its caller,
    decoding (one known token left to compute, the last generated one) and at least two tokens left to generate (a
    draft token and the bonus one).  O(1)."""
    sampling = request.sampling
    return (
        sampling.temperature == 0
        and request.forced is None
        and not request.external_verdict
        and bool(request.generated)
        and request.position == request.sequence_length() - 1
        and draft_room(request) > 0
    )


def draft_room(request: EngineRequest) -> int:
    """The most draft tokens worth verifying for ``request``: its tokens left to generate, less the bonus one."""
    return request.sampling.max_new_tokens - len(request.generated) - 1


class VerifyClock:
    """What a verify of ``k`` draft tokens costs in decode steps, learnt from the engine's own forwards.

    :meth:`observe` takes the seconds of forwards of one decoding row with ``k`` draft tokens (0: a plain decode
    step); each ``k`` keeps a moving average (weight ``1 - decay`` to the newest).  :meth:`costs` fits
    ``cost(k) = 1 + slope * k`` through the averages of the ``k >= 1`` seen ``min_samples`` times or more, relative to
    the decode step's (least squares through (0, 1); a slope below 0 counts as 0), for
    :class:`~prefixcache.engine.draft.DraftLength`: a straight line, so that lengths never drafted get a cost too.
    None until the decode step and one ``k`` were seen enough.  O(max_tokens)."""

    __slots__ = ("decay", "max_tokens", "min_samples", "samples", "seconds")

    def __init__(self, max_tokens: int, *, decay: float = 0.9, min_samples: int = 4) -> None:
        self.max_tokens = max_tokens
        self.decay = decay
        self.min_samples = min_samples
        self.seconds = [0.0] * (max_tokens + 1)
        self.samples = [0] * (max_tokens + 1)

    def observe(self, num_draft_tokens: int, seconds: float) -> None:
        """A forward of one decoding row with ``num_draft_tokens`` draft tokens took ``seconds``.  O(1)."""
        k = num_draft_tokens
        if not 0 <= k <= self.max_tokens or not seconds > 0:
            return
        n = self.samples[k]
        self.seconds[k] = seconds if n == 0 else self.decay * self.seconds[k] + (1 - self.decay) * seconds
        self.samples[k] = n + 1

    def costs(self) -> tuple[float, ...] | None:
        """``cost[k]`` for ``k`` in ``0 .. max_tokens`` (``cost[0] == 1``), or None (not enough seen)."""
        if self.samples[0] < self.min_samples:
            return None
        base = self.seconds[0]
        seen = [k for k in range(1, self.max_tokens + 1) if self.samples[k] >= self.min_samples]
        if not seen:
            return None
        slope = sum(k * (self.seconds[k] / base - 1) for k in seen) / sum(k * k for k in seen)
        slope = max(slope, 0.0)
        return tuple(1 + slope * k for k in range(self.max_tokens + 1))


@dataclass(slots=True, eq=False)
class _Drafting:
    """A request's drafting under :class:`TreeDrafts` (its ``draft_state``)."""

    session: DraftSession
    idle_steps: int = 0  # steps since its controller last gave it a budget


class TreeDrafts:
    """Drafts from the tokens already seen: a :class:`~prefixcache.engine.draft.Drafter` subscribed to ``cache``'s
    KV events (so it indexes the full blocks the tree holds, per namespace; a request drafts only from its own
    namespace), and per request a :class:`~prefixcache.engine.draft.DraftSession` (its context indexed once, then a
    token at a time; its adaptive :class:`~prefixcache.engine.draft.DraftLength` of at most ``max_draft_tokens``,
    ``verify_cost`` as there, else learnt: :attr:`clock`) kept in ``request.draft_state`` across preemptions.
    Where a request's controller drafts nothing (a verify costs more than the acceptance it expects brings), a draft
    of :data:`PROBE_TOKENS` every :data:`PROBE_EVERY_STEPS` steps probes the acceptance again, so that an answer that
    turns to copying is drafted for (else the estimate, never updated, only relaxes to its prior).

    One per runner (:meth:`~prefixcache.engine.runner.PrefixCachingRunner.tree_drafts`): cores stepping on several
    threads share it under its lock.  :meth:`close` unsubscribes it.  Cost: a lookup is O(n-gram sizes + k) dict
    reads (tens of microseconds, see :mod:`prefixcache.engine.draft`); a request's first proposal indexes its prompt,
    O(prompt) (about 0.5 us a token), unless it shares a long prefix with an earlier one.
    """

    def __init__(
        self,
        cache: RadixCache,
        max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
        verify_cost: Sequence[float] | None = None,
    ) -> None:
        self.drafter = Drafter(max_draft_tokens, block_size=cache.block_size)
        self.max_draft_tokens = max_draft_tokens
        self.verify_cost = None if verify_cost is None else tuple(verify_cost)
        DraftLength(max_draft_tokens, self.verify_cost)  # checks the cost table now rather than at the first draft
        self.cache = cache
        self.clock = VerifyClock(max_draft_tokens)
        """The cost of a verify as the engine measures it (:meth:`observe`); the draft lengths follow it where no
        ``verify_cost`` was given."""
        self._lock = threading.Lock()
        self.proposed_by_source = {"context": 0, "tree": 0}
        """Draft tokens proposed, by where they came from (the request's own context, or the cache's blocks)."""
        cache.subscribe(self.drafter)

    def propose(self, request: EngineRequest, max_tokens: int) -> Sequence[int]:
        """The draft after ``request``'s known tokens, of at most ``max_tokens`` and its controller's budget."""
        with self._lock:
            state = request.draft_state
            if not isinstance(state, _Drafting):
                length = DraftLength(self.max_draft_tokens, self.verify_cost)
                session = self.drafter.session(request.known_tokens(), request.namespace, length=length)
                state = request.draft_state = _Drafting(session)
            else:
                session = state.session
                seen = len(session.tokens) - len(request.prompt)
                if seen < len(request.generated):
                    session.extend(request.generated[seen:])
                session.namespace = request.namespace  # moved by a weight change while it waited to resume
            if self.verify_cost is None:
                costs = self.clock.costs()
                if costs is not None and costs != session.length.costs:
                    session.length.set_costs(costs)
            budget = min(session.length.next_budget(), max_tokens)
            if budget:
                state.idle_steps = 0
            else:
                state.idle_steps += 1
                if state.idle_steps >= PROBE_EVERY_STEPS:
                    budget = min(PROBE_TOKENS, max_tokens)
            proposal = self.drafter.lookup(session.index, session.namespace, budget) if budget > 0 else None
            if not proposal:
                session.length.update(0, 0)
                return ()
            self.proposed_by_source[proposal.source] += len(proposal)  # type: ignore[index]
            state.idle_steps = 0
            return proposal.tokens

    def observe(self, num_draft_tokens: int, seconds: float) -> None:
        """A forward of one decoding row with ``num_draft_tokens`` draft tokens took ``seconds`` (:attr:`clock`)."""
        with self._lock:
            self.clock.observe(num_draft_tokens, seconds)

    def verified(self, request: EngineRequest, num_proposed: int, num_accepted: int) -> None:
        """Tell the request's draft length controller how its draft fared."""
        state = request.draft_state
        if isinstance(state, _Drafting):
            with self._lock:
                state.session.length.update(num_proposed, num_accepted)

    def close(self) -> None:
        """Stop following the cache's events: the drafter's block index then keeps what it had (stale as the cache
        evicts); for a runner that stops speculating for good."""
        try:
            self.cache.unsubscribe(self.drafter)
        except InvalidArgumentError:
            pass  # closed already
