"""Predict speculative decoding drafted from the context and the cache, on the recorded answers of a replay.

For each request with a recorded answer the replay simulates greedy verification teacher forced on the answer's
tokens: at each step the :class:`~prefixcache.engine.draft.Drafter` proposes a draft from the request's own context
(prompt and answer so far), else from the full blocks the cache holds in the request's namespace (every earlier
request's prompt and answer there: the drafter follows the replay's cache through its KV events, evictions
included); the accepted part is the longest prefix of the draft equal to the next recorded tokens, and the step
yields it plus one token (the model's own, here the recorded one).  A request's first step is the one its prefill
would make: the draft rides along with the prompt's last token.  Every answer token counts, the template's closing
tokens included.

Tokens per verify step is answer tokens / forwards.  The projected decode speed-up divides answer tokens by the cost
of those forwards in decode steps: a forward verifying ``k`` draft tokens costs ``verify_cost[k]`` (1 for ``k = 0``),
:data:`DEFAULT_VERIFY_COST` unless given.

``python -m prefixcache.replay.speculate --time FILE [--tokenizer DIR]`` measures the drafter's cost per step on a
transcript file (the figures in :mod:`prefixcache.engine.draft`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np

from prefixcache.engine.draft import Drafter, DraftLength
from prefixcache.engine.draft_index import latest_matches, ngram_hashes_before
from prefixcache.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_COST_NOTE",
    "DEFAULT_VERIFY_COST",
    "SPECULATE_MODES",
    "SpeculationTally",
    "Speculator",
    "parse_verify_cost",
]

SPECULATE_MODES = ("off", "context", "tree")
"""``--speculate``: no prediction; drafts from the request's own context only (prompt-lookup decoding); from the
context, else from the cache's blocks."""

DEFAULT_VERIFY_COST = (1.0, 1.27, 1.58, 1.67, 1.97, 1.98, 2.13, 2.18, 2.21)
"""The cost of a forward verifying ``k`` draft tokens (index ``k``) in decode steps: the embedded ``small`` preset
(8 layers, hidden 512, float32) at 2,048 tokens of context with the engine's forward against live K/V, on this
project's 2-core development machine with one torch thread (``python -m prefixcache.replay.verify_cost --threads 1
--repeats 6``: one token 72 ms while other jobs loaded the machine, 2 tokens 92 ms, 9 tokens 159 ms).  Two threads
on that loaded machine gave 5-8x for every draft length, a contention figure, not the forward's.  A GPU decoding a
larger model is bound by reading weights and K/V and verifies 9 tokens for little more than one: pass its own
figures with ``--verify-cost``."""

DEFAULT_COST_NOTE = "the small preset at 2k context on a 2-core CPU, one thread"
"""Where :data:`DEFAULT_VERIFY_COST` was measured, as the replay report names it."""


def parse_verify_cost(text: str) -> tuple[float, ...]:
    """``--verify-cost``: comma-separated costs of verifying ``k = 1, 2, ...`` draft tokens in decode steps (a
    draft longer than the list costs its last value); ``"1"`` models a verify as cheap as a decode step.
    Returns the table indexed by ``k`` (``[0]`` is 1).

    Raises:
        InvalidArgumentError: not positive numbers, or fewer than one.
    """
    try:
        costs = [float(part) for part in text.split(",")]
    except ValueError:
        raise InvalidArgumentError(f"--verify-cost {text!r}: give numbers separated by commas, e.g. 1.1,1.2") from None
    if not costs or any(not 1 <= c < float("inf") for c in costs):
        raise InvalidArgumentError(
            f"--verify-cost {text!r}: costs are decode steps, at least 1 (a verify runs at least one forward)"
        )
    return (1.0, *costs)


def costs_by_length(verify_cost: Sequence[float], max_draft_tokens: int = 8) -> tuple[float, ...]:
    """``verify_cost`` as the simulation charges it: indexed by draft length ``0 .. max_draft_tokens``, cut there or
    its last value repeated (:class:`~prefixcache.engine.draft.DraftLength`'s table)."""
    return DraftLength(max_draft_tokens, verify_cost).costs


@dataclass(slots=True)
class SpeculationTally:
    """What the simulated verification of the answers gave, two ways.

    With full drafts (every draft as long as the drafter found, up to the maximum): ``answer_tokens`` were produced in
    ``steps`` forwards (``context_steps`` / ``tree_steps`` of them verified a draft from that source, making
    ``context_tokens`` / ``tree_tokens``), ``proposed_tokens`` draft tokens were verified and ``accepted_tokens`` of
    them kept, and the forwards cost ``cost`` decode steps.  With the adaptive draft length
    (:class:`~prefixcache.engine.draft.DraftLength` at the verify cost): ``adaptive_steps`` forwards costing
    ``adaptive_cost``, ``adaptive_proposed_tokens`` draft tokens verified.
    """

    requests: int = 0
    answer_tokens: int = 0
    steps: int = 0
    context_steps: int = 0
    context_tokens: int = 0
    tree_steps: int = 0
    tree_tokens: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    cost: float = 0.0
    adaptive_steps: int = 0
    adaptive_proposed_tokens: int = 0
    adaptive_cost: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        """Answer tokens per forward with full drafts (1.0 means no gain)."""
        return self.answer_tokens / self.steps if self.steps else 0.0

    @property
    def speedup(self) -> float:
        """Decode steps the answers would take without drafts, over the cost of the forwards with full drafts."""
        return self.answer_tokens / self.cost if self.cost else 0.0

    @property
    def adaptive_tokens_per_step(self) -> float:
        """Answer tokens per forward with the adaptive draft length."""
        return self.answer_tokens / self.adaptive_steps if self.adaptive_steps else 0.0

    @property
    def adaptive_speedup(self) -> float:
        """Decode steps the answers would take without drafts, over the cost of the forwards with the adaptive
        draft length: the projected decode speed-up."""
        return self.answer_tokens / self.adaptive_cost if self.adaptive_cost else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Draft tokens accepted over draft tokens verified, with full drafts."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    def source_tokens_per_step(self, source: str) -> float:
        """Tokens per forward over the forwards whose draft came from ``source`` (``"context"`` or ``"tree"``)."""
        if source == "context":
            return self.context_tokens / self.context_steps if self.context_steps else 0.0
        return self.tree_tokens / self.tree_steps if self.tree_steps else 0.0

    def add(self, other: SpeculationTally) -> None:
        """Add ``other``'s counts to this one's."""
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = asdict(self)
        out["tokens_per_step"] = self.tokens_per_step
        out["context_tokens_per_step"] = self.source_tokens_per_step("context")
        out["tree_tokens_per_step"] = self.source_tokens_per_step("tree")
        out["acceptance_rate"] = self.acceptance_rate
        out["full_draft_speedup"] = self.speedup
        out["adaptive_tokens_per_step"] = self.adaptive_tokens_per_step
        out["projected_speedup"] = self.adaptive_speedup
        return out


def _extends(prompt: Any, previous: Any) -> bool:
    """Whether ``prompt`` starts with ``previous``'s prompt and answer."""
    before = len(previous.prompt)
    end = before + len(previous.answer)
    return len(prompt) >= end and prompt[:before] == previous.prompt and prompt[before:end] == previous.answer


class _Plan(NamedTuple):
    """One request's answer, its context drafts worked out before the replay (they do not depend on the cache).

    Per answer position ``i``: ``ctx_row[i]``, the row in the drafter's sizes of the longest context suffix that has
    a draft there (``len(sizes)``: none); that draft's length and how many of its tokens equal the answer's next ones.
    ``queries[row]``: the positions a tree lookup of that size may be asked at (no context draft of that size or
    longer, ``n`` tokens before them) and their n-gram hashes.  ``tail``: the ``max_n`` prompt tokens before the
    answer and the answer, as ints.
    """

    ctx_row: list[int]
    num_draft: list[int]
    num_matching: list[int]
    queries: list[tuple[list[int], list[int]]]
    tail: list[int]
    lead: int


class Speculator:
    """Simulates drafting and verification for the requests of one replayed file, in replay order.

    ``mode``: ``"context"`` or ``"tree"`` (see :data:`SPECULATE_MODES`).  Subscribe :attr:`drafter` to the replay's
    cache before the first request (mode ``"tree"``), and call :meth:`run` for each request before the cache commits
    it.  A draft depends only on the context, and teacher forcing makes the context at answer position ``i`` the
    prompt and the first ``i`` answer tokens whatever was drafted before, so the drafter is asked once per answer
    position for its full draft, and both ways of verifying (full drafts, adaptive length) are played over those.

    The context side does not depend on the cache, so it is worked out for every request when the speculator is
    made, a conversation at a time: while each prompt extends the turn before's prompt and answer, every answer
    position of the conversation is matched in one NumPy pass over its tokens
    (:func:`~prefixcache.engine.draft_index.latest_matches`), the prefix it shares with an earlier conversation read
    from that one's :class:`~prefixcache.engine.draft.SharedPrefix`.  That tells which n-grams a tree lookup can be
    asked for (those at answer positions without a context draft as long), and the drafter indexes only those of
    the cached blocks (:meth:`~prefixcache.engine.draft.Drafter.restrict_tree`).
    """

    def __init__(
        self,
        requests: Sequence[Any],
        mode: str = "tree",
        verify_cost: Sequence[float] = DEFAULT_VERIFY_COST,
        max_draft_tokens: int = 8,
    ) -> None:
        if mode not in SPECULATE_MODES[1:]:
            raise InvalidArgumentError(f"unknown speculation mode {mode!r}; choose one of {SPECULATE_MODES[1:]}")
        self.mode = mode
        self.verify_cost = DraftLength(max_draft_tokens, verify_cost).costs
        self.drafter = Drafter(max_draft_tokens, use_tree=mode == "tree")
        self.tally = SpeculationTally()
        self._plans: dict[int, _Plan] = {}
        tree_keys = self._plan(requests)
        if mode == "tree":
            self.drafter.restrict_tree(tree_keys)

    def _plan(self, requests: Sequence[Any]) -> dict[int, np.ndarray]:
        """Work out every request's context drafts; return the n-grams (by size) a tree lookup may be asked for."""
        conversations: dict[str, list[Any]] = {}
        for request in requests:
            conversations.setdefault(request.conversation_id, []).append(request)
        wanted: dict[int, list[np.ndarray]] = {n: [] for n in self.drafter.ngram_sizes}
        for turns in conversations.values():
            chain: list[Any] = []  # turns whose prompts extend the turn before's prompt and answer
            for request in turns:
                answer, prompt = request.answer, request.prompt
                if chain and not (len(answer) and _extends(prompt, chain[-1])):
                    self._plan_chain(chain, wanted)
                    chain = []
                if len(answer):  # as a decode would: a request without an answer ends the kept context
                    chain.append(request)
            if chain:
                self._plan_chain(chain, wanted)
        return {n: np.unique(np.concatenate(keys)) if keys else np.zeros(0, np.uint64) for n, keys in wanted.items()}

    def _plan_chain(self, chain: list[Any], wanted: dict[int, list[np.ndarray]]) -> None:
        """Plan the turns of one context, each prompt extending the turn before's prompt and answer: every answer
        position of the whole context matched at once (:func:`~prefixcache.engine.draft_index.latest_matches`)."""
        sizes, k = self.drafter.ngram_sizes, self.drafter.max_draft_tokens
        last = chain[-1]
        tokens = np.frombuffer(last.prompt + last.answer, dtype=np.uint32).astype(np.int64)
        shared = self.drafter.shared_prefix(chain[0].prompt)
        shared_tokens = shared.common_prefix(tokens[: len(chain[0].prompt)]) if shared is not None else 0
        starts = [len(r.prompt) for r in chain]
        lengths = [len(r.answer) for r in chain]
        queries = np.concatenate([np.arange(s, s + m, dtype=np.int64) for s, m in zip(starts, lengths, strict=True)])
        ends = np.repeat(np.array(starts, dtype=np.int64) + lengths, lengths)  # each answer's end: its context's
        total = len(queries)
        ctx_row = np.full(total, len(sizes), dtype=np.int64)
        num_draft = np.zeros(total, dtype=np.int64)
        num_matching = np.zeros(total, dtype=np.int64)
        ahead = np.arange(k)
        last_token = len(tokens) - 1
        asked_by_size = []
        for row, n in enumerate(sizes):
            open_at = np.flatnonzero(ctx_row == len(sizes))
            found = np.full(total, -1, dtype=np.int64)
            found[open_at] = latest_matches(tokens, n, queries[open_at], shared, shared_tokens)
            hit = np.flatnonzero(found >= 0)
            if len(hit):
                p, q = found[hit], queries[hit]
                length = np.minimum(k, q - p)  # a draft ends where the context does
                usable = np.minimum(length, ends[hit] - q)[:, None] > ahead
                same = (
                    tokens[np.minimum(p[:, None] + ahead, last_token)]
                    == tokens[np.minimum(q[:, None] + ahead, last_token)]
                )
                num_matching[hit] = np.cumprod(same & usable, axis=1).sum(axis=1)
                num_draft[hit] = length
                ctx_row[hit] = row
            asked = np.flatnonzero((ctx_row > row) & (queries >= n))  # a tree lookup needs n tokens before
            keys = ngram_hashes_before(tokens, queries[asked], n)
            wanted[n].append(keys)
            asked_by_size.append((asked, keys))
        max_n = max(sizes)
        at = 0
        for request, start, m in zip(chain, starts, lengths, strict=True):
            lead = min(start, max_n)
            plan_queries = []
            for asked, keys in asked_by_size:
                lo, hi = np.searchsorted(asked, [at, at + m])
                plan_queries.append(((asked[lo:hi] - at).tolist(), keys[lo:hi].tolist()))
            self._plans[id(request)] = _Plan(
                ctx_row[at : at + m].tolist(),
                num_draft[at : at + m].tolist(),
                num_matching[at : at + m].tolist(),
                plan_queries,
                tokens[start - lead : start + m].tolist(),
                lead,
            )
            at += m

    def run(self, request: Any, namespace: str | None = None) -> None:
        """Simulate the decoding of ``request.answer`` after ``request.prompt`` and add it to :attr:`tally` (a request
        without an answer adds nothing): its context drafts as planned, a tree lookup in the cache as it is now
        where a context draft is missing.  O(answer tokens), plus a tree lookup per position without a context
        draft."""
        plan = self._plans.pop(id(request), None)
        if plan is None:
            return
        num_draft, num_matching = plan.num_draft, plan.num_matching
        ctx_row = plan.ctx_row
        from_context = [row < len(self.drafter.ngram_sizes) for row in ctx_row]
        tree = self.drafter.tree(namespace) if self.mode == "tree" else None
        if tree is not None:
            k, tail, lead = self.drafter.max_draft_tokens, plan.tail, plan.lead
            done: set[int] = set()
            for n, (asked, keys) in zip(self.drafter.ngram_sizes, plan.queries, strict=True):
                for i, h in zip(asked, keys, strict=True):
                    if i in done:
                        continue
                    q = lead + i
                    draft = tree.lookup(n, h, tail[q - n : q], k)
                    if draft:
                        run = 0
                        for expected, drafted in zip(tail[q : q + len(draft)], draft, strict=False):
                            if expected != drafted:
                                break
                            run += 1
                        num_draft[i], num_matching[i], from_context[i] = len(draft), run, False
                        done.add(i)
        self._verify(num_draft, num_matching, from_context)

    def _verify(self, num_draft: list[int], num_matching: list[int], from_context: list[bool]) -> None:
        tally, costs = self.tally, self.verify_cost
        end = len(num_draft)
        tally.requests += 1
        tally.answer_tokens += end
        i = 0
        while i < end:
            drafted = num_draft[i]
            tally.steps += 1
            tally.cost += costs[drafted]
            if drafted:
                run = num_matching[i]
                produced = min(run + 1, end - i)
                tally.proposed_tokens += drafted
                tally.accepted_tokens += run
                if from_context[i]:
                    tally.context_steps += 1
                    tally.context_tokens += produced
                else:
                    tally.tree_steps += 1
                    tally.tree_tokens += produced
                i += produced
            else:
                i += 1
        verified = DraftLength(self.drafter.max_draft_tokens, costs).forced_steps(num_draft, num_matching)
        tally.adaptive_steps += len(verified)
        tally.adaptive_proposed_tokens += sum(verified)
        for k in verified:
            tally.adaptive_cost += costs[k]


def main(argv: list[str] | None = None) -> int:
    """``--time FILE``: the drafter's cost per propose and per appended token on a transcript file's requests."""
    from prefixcache.chat.tokenizer import ByteTokenizer
    from prefixcache.replay.requests import read_requests

    parser = argparse.ArgumentParser(prog="python -m prefixcache.replay.speculate")
    parser.add_argument("--time", metavar="FILE", required=True, help="a transcript file")
    parser.add_argument("--tokenizer", metavar="DIR", help="a Hugging Face tokenizer folder (default: bytes)")
    parser.add_argument("--limit", type=int, default=40, help="conversations (default 40)")
    args = parser.parse_args(argv)
    if args.tokenizer:
        from prefixcache.chat.hf_tokenizer import HFTokenizer

        tokenizer = HFTokenizer(args.tokenizer)
    else:
        tokenizer = ByteTokenizer()
    requests = read_requests(args.time, tokenizer, limit=args.limit).requests
    drafter = Drafter()
    for request in requests:
        drafter.add_sequence(request.prompt + request.answer)
    drafter.sync()
    start_s = propose_s = extend_s = 0.0
    proposals = appended = 0
    for request in requests:
        t0 = time.perf_counter()
        session = drafter.session(request.prompt)
        t1 = time.perf_counter()
        answer = request.answer.tolist()
        for i, token in enumerate(answer):
            t2 = time.perf_counter()
            session.propose()
            t3 = time.perf_counter()
            session.advance(answer[i : i + 1], 0, 0)
            extend_s += time.perf_counter() - t3
            propose_s += t3 - t2
            proposals += 1
            appended += token >= 0
        start_s += t1 - t0
    prompts = sum(len(r.prompt) for r in requests) / len(requests)
    print(f"{len(requests)} requests, prompts of {prompts:,.0f} tokens on average, {proposals:,} proposals")
    print(f"propose: {1e6 * propose_s / proposals:.1f} us; append a token: {1e6 * extend_s / appended:.1f} us; ")
    print(f"session start (index the prompt): {1e3 * start_s / len(requests):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
