"""Drafts for speculative decoding taken from the tokens already seen: the request's own context, then the cache.

Agent answers copy their context (ids, JSON keys, argument values from tool results and earlier calls), so the tokens
that followed the request's last few tokens elsewhere are a good guess at what comes next.  At each decode step
:meth:`DraftSession.propose` matches the last 4, 3, 2 or 1 tokens of the request's context (prompt and tokens so far)
in that context (prompt-lookup decoding, vLLM's ``ngram`` method), else in every full block cached in the request's
namespace (what followed the same tokens in any cached sequence the request may read, never another namespace's),
before trying a shorter suffix, and proposes the up to ``k`` tokens that followed the latest occurrence.  (Trying
every length in the context before the cache drafts less well: on tau-bench with the Qwen2.5 tokenizer 2.45 tokens
per verify step with full drafts, against 2.87 this way.)  One forward then scores the ``1 + k`` positions
and keeps the longest prefix of the draft that the model agrees with, plus its own next token.

The cache side is kept in step with the radix tree by its KV events: ``cache.subscribe(drafter)`` sends every full
block stored and removed (:mod:`prefixcache.cache.events`); the drafter only queues them (O(1) inside the cache's
lock) and indexes them at the next :meth:`Drafter.propose` or :meth:`Drafter.sync`: O(block_size x ngram sizes) a
block, about 2 us a block with NumPy, and one dict entry per distinct n-gram position (see
:class:`~prefixcache.engine.draft_index.BlockTree`).  So the drafter holds what the tree holds, block by block:
eviction removes a block's n-grams, and a partial last block (never announced) is not drafted from until a longer
sequence fills it.

The context side indexes each request's tokens once per n-gram size (:class:`ContextIndex`): a decode appends a
token a step, a conversation's next turn extends the index its previous turn left, and a prompt that starts like an
earlier long one (a system prompt and its tools) reads that shared part from the earlier one's static
:class:`SharedPrefix` instead of indexing it again (:meth:`Drafter.context`).  A replay, teacher forced on recorded
answers, matches every answer position of a conversation at once
(:func:`~prefixcache.engine.draft_index.latest_matches`, NumPy) and, knowing every context it will draft for, has
the cache side index only the n-grams it will look up (:meth:`Drafter.restrict_tree`).

:class:`DraftLength` adapts ``k`` per request to the cost of a verify: it estimates from the request's drafts how
likely a draft's first token and each following one are accepted, and drafts the length that yields the most tokens
per unit of cost, growing after acceptances, shrinking after rejections, and proposing nothing where drafts keep
failing and a verify costs more than a decode step.

Cost, measured on tau-bench's airline transcripts with the Qwen2.5 tokenizer (40 conversations, 571 requests, prompts
of 5,673 tokens on average; ``python -m prefixcache.replay.speculate --time
../shared/data/tau_bench_airline_gpt4o.jsonl --tokenizer ../shared/data/tokenizers/qwen2.5-0.5b-instruct``) on this
project's 2-core development machine while other jobs loaded it (a Python multiply-add loop ran 8x slower than on
the idle machine): 18 us per :meth:`DraftSession.propose`, 15 us per token appended, 16 ms to start a session on a
prompt (indexing it); on the idle machine expect about an eighth.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from prefixcache.cache.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    block_hashes,
    namespace_root_hash,
)
from prefixcache.cache.pool import check_block_size
from prefixcache.cache.tokens import as_token_array
from prefixcache.engine.draft_index import BlockTree, ContextIndex, SharedPrefix
from prefixcache.errors import InvalidArgumentError

__all__ = ["ContextIndex", "DraftLength", "DraftProposal", "DraftSession", "Drafter", "SharedPrefix"]

DraftSource = Literal["context", "tree"]

DEFAULT_NGRAM_SIZES = (4, 3, 2, 1)
DEFAULT_MAX_DRAFT_TOKENS = 8
_NAMESPACES_UNSET = object()

SHARED_PREFIX_MIN_TOKENS = 1024
"""A context of this many tokens or more that shares less than half of them with the drafter's shared prefixes
becomes one itself (:meth:`Drafter.context`)."""

MAX_SHARED_PREFIXES = 4
"""Shared prefixes a drafter keeps, the oldest dropped first."""


@dataclass(frozen=True, slots=True)
class DraftProposal:
    """The tokens proposed after a context (empty: nothing to propose, decode one token) and where they came from:
    ``"context"`` (the request's own tokens) or ``"tree"`` (the namespace's cached blocks); ``ngram_tokens`` is the
    length of the context suffix that matched (0 with no draft)."""

    tokens: tuple[int, ...] = ()
    source: DraftSource | None = None
    ngram_tokens: int = 0

    def __len__(self) -> int:
        return len(self.tokens)


NO_DRAFT = DraftProposal()


class DraftLength:
    """Per request: how many tokens to draft at the next step (:meth:`next_budget`; 0: none), from the cost of a
    verify and the acceptance seen so far.

    ``verify_cost[k]`` is the cost of a forward verifying ``k`` draft tokens in decode steps (``[0]`` is 1; a longer
    draft costs the last value; default: all 1, a verify as cheap as a decode step).  Two acceptance estimates, moving
    averages over the request's drafts (weight ``1 - decay`` to the newest): ``p_first``, that a draft's first token
    is accepted, and ``p_next``, that a token after an accepted one is.  A draft of ``k`` tokens then yields
    ``1 + p_first * (1 - p_next**k) / (1 - p_next)`` tokens on average, and the budget is the ``k`` in
    ``0 .. max_tokens`` that gives the most tokens per cost.  So a draft accepted whole grows it, a rejection shrinks
    it, and where drafts keep failing ``p_first`` falls until no draft pays for its verify (with a flat cost, only
    when it reaches 0): nothing is proposed then, while ``p_first`` moves back toward its prior by ``relax`` of the
    gap each step without a draft, so drafting is tried again later.  O(max_tokens) a step.
    """

    __slots__ = ("_budget", "costs", "decay", "max_tokens", "p_first", "p_next", "prior_first", "relax")

    def __init__(
        self,
        max_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
        verify_cost: Sequence[float] | None = None,
        *,
        prior_first: float = 0.5,
        prior_next: float = 0.8,
        decay: float = 0.8,
        relax: float = 0.05,
    ) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be a positive int, got {max_tokens!r}")
        for name, value in (("prior_first", prior_first), ("prior_next", prior_next), ("decay", decay),
                            ("relax", relax)):  # fmt: skip
            if not 0 <= value <= 1:
                raise InvalidArgumentError(f"{name} must be in [0, 1], got {value!r}")
        self.max_tokens = max_tokens
        self.costs = self._cost_table(verify_cost)
        self.prior_first = prior_first
        self.p_first = prior_first
        self.p_next = prior_next
        self.decay = decay
        self.relax = relax
        self._budget: int | None = None

    def _cost_table(self, verify_cost: Sequence[float] | None) -> tuple[float, ...]:
        costs = list(verify_cost) if verify_cost is not None else [1.0]
        if not costs or any(not c > 0 for c in costs):
            raise InvalidArgumentError(f"verify_cost must hold positive numbers, got {verify_cost!r}")
        costs += [costs[-1]] * (self.max_tokens + 1 - len(costs))
        return tuple(costs[: self.max_tokens + 1])

    def set_costs(self, verify_cost: Sequence[float]) -> None:
        """Replace the cost table (as the constructor's ``verify_cost``; a measured one, say).  O(max_tokens).

        Raises:
            InvalidArgumentError: a cost that is not a positive number (the table is left as it was).
        """
        self.costs = self._cost_table(verify_cost)
        self._budget = None

    def expected_tokens(self, num_draft_tokens: int) -> float:
        """Tokens a verify of a draft of ``num_draft_tokens`` yields on average, by the current estimates."""
        q = self.p_next
        run = num_draft_tokens if q >= 1 else (1 - q**num_draft_tokens) / (1 - q)
        return 1 + self.p_first * run

    def next_budget(self) -> int:
        """The number of tokens to draft now (0: none).  O(max_tokens), cached until the next :meth:`update`."""
        if self._budget is None:
            p_first, q, costs = self.p_first, self.p_next, self.costs
            best, best_rate, run, q_k = 0, 1.0, 0.0, 1.0
            for k in range(1, self.max_tokens + 1):
                run += q_k  # 1 + q + ... + q**(k - 1): the accepted run's expected length, given the first
                q_k *= q
                rate = (1 + p_first * run) / costs[k]
                if rate > best_rate:
                    best, best_rate = k, rate
            self._budget = best
        return self._budget

    def update(self, num_proposed: int, num_accepted: int) -> None:
        """Account one decode step: ``num_proposed`` draft tokens verified (0: none was proposed), ``num_accepted``
        of them accepted.

        Raises:
            InvalidArgumentError: ``num_accepted`` outside ``0 .. num_proposed``.
        """
        if not 0 <= num_accepted <= num_proposed:
            raise InvalidArgumentError(f"num_accepted {num_accepted} is not in 0 .. num_proposed {num_proposed}")
        self._budget = None
        if not num_proposed:
            self.p_first += (self.prior_first - self.p_first) * self.relax
            return
        decay = self.decay
        self.p_first = decay * self.p_first + (1 - decay) * (num_accepted > 0)
        if num_accepted:
            followed = num_accepted - 1 + (num_accepted < num_proposed)  # tokens after an accepted one, verified
            if followed:
                self.p_next = decay * self.p_next + (1 - decay) * (num_accepted - 1) / followed

    def forced_steps(self, num_draft_tokens: Sequence[int], num_matching: Sequence[int]) -> list[int]:
        """Play the controller over a decode teacher forced on known tokens: at position ``i`` a full draft of
        ``num_draft_tokens[i]`` tokens, the first ``num_matching[i]`` of them right.  Each step drafts ``k``, the
        smaller of the full draft and :meth:`next_budget`, accepts ``min(num_matching[i], k)``, moves past the
        accepted tokens and the model's own one, and calls :meth:`update`.  Returns each step's ``k``; the estimates
        are left as the steps' updates leave them.  The same as those calls (the arithmetic inlined): O(steps x
        max_tokens)."""
        costs, max_tokens, decay, relax = self.costs, self.max_tokens, self.decay, self.relax
        prior_first = self.prior_first
        p_first, p_next = self.p_first, self.p_next
        end = len(num_draft_tokens)
        out = []
        i = 0
        while i < end:
            drafted = num_draft_tokens[i]
            k = 0
            if drafted:  # without a draft the budget does not matter
                best, best_rate, run, q_k = 0, 1.0, 0.0, 1.0
                for j in range(1, max_tokens + 1):
                    run += q_k
                    q_k *= p_next
                    rate = (1 + p_first * run) / costs[j]
                    if rate > best_rate:
                        best, best_rate = j, rate
                k = drafted if drafted < best else best
            out.append(k)
            if k:
                accepted = num_matching[i] if num_matching[i] < k else k
                p_first = decay * p_first + (1 - decay) * (accepted > 0)
                if accepted:
                    followed = accepted - 1 + (accepted < k)
                    if followed:
                        p_next = decay * p_next + (1 - decay) * (accepted - 1) / followed
            else:
                accepted = 0
                p_first += (prior_first - p_first) * relax
            i += accepted + 1
        self.p_first, self.p_next, self._budget = p_first, p_next, None
        return out


class Drafter:
    """Proposes drafts from a request's context and from the full blocks cached per namespace.

    ``max_draft_tokens``: the most tokens a draft holds.  ``ngram_sizes``: the context suffix lengths tried, longest
    first (default 4, 3, 2, 1).  ``block_size``: the cache's (taken from the first event when None; 16 for
    :meth:`add_sequence` before any).  ``use_tree=False`` drafts from the context only (prompt-lookup decoding).
    A callable KV event listener: subscribe it to the cache it drafts from.
    Not thread-safe, except that events may be delivered from another thread (they are queued).
    """

    def __init__(
        self,
        max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
        ngram_sizes: Sequence[int] = DEFAULT_NGRAM_SIZES,
        *,
        block_size: int | None = None,
        use_tree: bool = True,
    ) -> None:
        if isinstance(max_draft_tokens, bool) or not isinstance(max_draft_tokens, int) or max_draft_tokens < 1:
            raise InvalidArgumentError(f"max_draft_tokens must be a positive int, got {max_draft_tokens!r}")
        sizes = tuple(ngram_sizes)
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64 for n in sizes):
            raise InvalidArgumentError(f"ngram_sizes must be ints in 1 .. 64, got {ngram_sizes!r}")
        if block_size is not None:
            check_block_size(block_size)
        self.max_draft_tokens = max_draft_tokens
        self.ngram_sizes = tuple(sorted(set(sizes), reverse=True))
        self.block_size = block_size
        self.use_tree = use_tree
        self._trees: dict[str | None, BlockTree] = {}
        self._pending: collections.deque[KVEvent] = collections.deque()
        self._shared: list[SharedPrefix] = []
        self._tree_keys: dict[int, np.ndarray] | None = None

    # ---- the cache side -------------------------------------------------------------------------------------

    def __call__(self, event: KVEvent) -> None:
        """Queue one KV event (the cache calls this inside its lock: O(1)); it is applied at the next lookup."""
        self._pending.append(event)

    def sync(self) -> None:
        """Apply the queued KV events.  O(blocks in them x block_size x sizes).

        Raises:
            InvalidArgumentError: an event of another block size than the drafter's.
        """
        pending = self._pending
        while pending:
            event = pending.popleft()
            if isinstance(event, BlockStored):
                self._tree(event.namespace, event.block_size).store(
                    event.block_hashes, event.parent_block_hash, event.token_ids, event.medium
                )
            elif isinstance(event, BlockRemoved):
                tree = self._trees.get(event.namespace)
                if tree is not None:
                    tree.remove(event.block_hashes, event.medium)
            elif isinstance(event, AllCleared):
                self._trees.clear()

    def _tree(self, namespace: str | None, block_size: int) -> BlockTree:
        if self.block_size is None:
            self.block_size = block_size
        elif block_size != self.block_size:
            raise InvalidArgumentError(f"a KV event of block size {block_size}; the drafter's is {self.block_size}")
        tree = self._trees.get(namespace)
        if tree is None:
            tree = self._trees[namespace] = BlockTree(block_size, self.ngram_sizes, self._tree_keys)
        return tree

    def restrict_tree(self, keys: dict[int, np.ndarray]) -> None:
        """Index only these n-grams of the cached blocks from now on: ``keys[n]``, the sorted distinct hashes
        (:func:`~prefixcache.engine.draft_index.suffix_hashes`) of the ``n``-token suffixes a tree lookup will be
        asked for, known ahead by a caller that knows every context it will draft for (a replay); a lookup of
        another n-gram misses.  Call it before the first event.

        Raises:
            InvalidArgumentError: blocks are indexed already, or ``keys`` lacks a size.
        """
        self.sync()
        if self._trees:
            raise InvalidArgumentError("restrict_tree must come before any block is indexed")
        if set(keys) != set(self.ngram_sizes):
            raise InvalidArgumentError(f"restrict_tree needs keys for the sizes {self.ngram_sizes}, got {sorted(keys)}")
        self._tree_keys = {n: np.asarray(keys[n], dtype=np.uint64) for n in self.ngram_sizes}

    def add_sequence(self, token_ids: Iterable[int], namespace: str | None = None) -> int:
        """Index the full blocks of a sequence as if a cache had stored it in ``namespace`` (blocks already held are
        skipped; a partial last block is not indexed, as the cache announces none).  Returns the blocks added.
        O(tokens): one xxh64 a block.

        Raises:
            InvalidTokensError, NamespaceError: what :func:`~prefixcache.cache.events.block_hashes` refuses.
        """
        self.sync()
        bs = self.block_size or 16
        ids = as_token_array(token_ids, allow_empty=True)
        hashes = block_hashes(ids, bs, namespace)
        if not hashes:
            return 0
        return self._tree(namespace, bs).store(hashes, namespace_root_hash(namespace), ids[: len(hashes) * bs])

    def forget(self, namespace: str | None | object = _NAMESPACES_UNSET) -> None:
        """Drop what is indexed for ``namespace`` (every namespace when none is given).  O(1)."""
        self.sync()
        if namespace is _NAMESPACES_UNSET:
            self._trees.clear()
        else:
            self._trees.pop(namespace, None)  # type: ignore[call-overload]

    def num_blocks(self, namespace: str | None = None) -> int:
        """Blocks indexed for ``namespace`` (after applying the queued events)."""
        self.sync()
        tree = self._trees.get(namespace)
        return tree.num_blocks if tree is not None else 0

    def check_invariants(self) -> None:
        """Check every namespace's block tree (:meth:`BlockTree.check_invariants`).  Raises AssertionError."""
        self.sync()
        for tree in self._trees.values():
            tree.check_invariants()

    # ---- lookups --------------------------------------------------------------------------------------------

    def shared_prefix(self, token_ids: Iterable[int]) -> SharedPrefix | None:
        """The kept :class:`SharedPrefix` sharing the most first tokens with ``token_ids`` (a context's start: a
        system prompt and its tools), or None.  A context of :data:`SHARED_PREFIX_MIN_TOKENS` or more sharing less
        than half of it with every kept prefix becomes a shared prefix itself (O(len x log len) with NumPy, once);
        the :data:`MAX_SHARED_PREFIXES` latest are kept.  O(shared tokens) otherwise.

        Raises:
            InvalidTokensError: what :func:`~prefixcache.cache.tokens.as_token_array` refuses.
        """
        ids = as_token_array(token_ids, allow_empty=True)
        tokens = np.frombuffer(ids, dtype=np.uint32) if len(ids) else np.zeros(0, dtype=np.uint32)
        best, best_len = None, 0
        for shared in self._shared:
            common = shared.common_prefix(tokens)
            if common > best_len:
                best, best_len = shared, common
        if 2 * best_len < len(ids) and len(ids) >= SHARED_PREFIX_MIN_TOKENS:
            best = SharedPrefix(self.ngram_sizes, tokens)
            self._shared = [*self._shared[1 - MAX_SHARED_PREFIXES :], best]
        return best

    def context(self, token_ids: Iterable[int]) -> ContextIndex:
        """A request's context indexed, reading the prefix it shares with an earlier long context from that
        context's :class:`SharedPrefix` (:meth:`shared_prefix`) rather than indexing it again: O(tokens past the
        shared prefix), about 0.5 us a token with NumPy.

        Raises:
            InvalidTokensError: what :func:`~prefixcache.cache.tokens.as_token_array` refuses.
        """
        ids = as_token_array(token_ids, allow_empty=True)
        tokens = np.frombuffer(ids, dtype=np.uint32) if len(ids) else np.zeros(0, dtype=np.uint32)
        best = self.shared_prefix(ids)
        return ContextIndex(self.ngram_sizes, tokens, shared=best)

    def session(self, token_ids: Iterable[int], namespace: str | None = None, *,
                length: DraftLength | None = None) -> DraftSession:  # fmt: skip
        """A request's drafting state: its context indexed (:meth:`context`) and its draft length controller (a fresh
        :class:`DraftLength` of ``max_draft_tokens`` unless given)."""
        return DraftSession(self, namespace, self.context(token_ids), length or DraftLength(self.max_draft_tokens))

    def propose(
        self, context_token_ids: Iterable[int], namespace: str | None = None, *, max_tokens: int | None = None
    ) -> DraftProposal:
        """A draft of up to ``max_tokens`` (default ``max_draft_tokens``) tokens to follow ``context_token_ids``,
        without a session: the context is indexed for this call, O(len(context)).  A decode loop keeps a
        :meth:`session` instead, which indexes each token once."""
        index = ContextIndex(self.ngram_sizes, as_token_array(context_token_ids, allow_empty=True))
        return self.lookup(index, namespace, self.max_draft_tokens if max_tokens is None else max_tokens)

    def tree(self, namespace: str | None = None) -> BlockTree | None:
        """``namespace``'s block tree after applying the queued events, or None (nothing cached there, or
        ``use_tree=False``)."""
        if not self.use_tree:
            return None
        if self._pending:
            self.sync()
        return self._trees.get(namespace)

    def lookup(self, index: ContextIndex, namespace: str | None, num_tokens: int) -> DraftProposal:
        """The draft after the context ``index`` holds: its last ``n`` tokens (``n`` in :attr:`ngram_sizes`, longest
        first) matched in the context itself, else in ``namespace``'s blocks, before a shorter ``n`` is tried; the up
        to ``num_tokens`` tokens after the latest match.  O(sizes + num_tokens) dict lookups and slices."""
        if num_tokens <= 0 or not len(index):
            return NO_DRAFT
        tree = None
        if self.use_tree:
            if self._pending:
                self.sync()
            tree = self._trees.get(namespace)
        hashes = index.tail
        suffix = index.tokens[-self.ngram_sizes[0] :]
        for n in self.ngram_sizes:
            draft = index.lookup(n, num_tokens)
            if draft:
                return DraftProposal(tuple(draft), "context", n)
            if tree is not None and n <= len(hashes):
                draft = tree.lookup(n, hashes[n - 1], suffix[len(suffix) - n :], num_tokens)
                if draft:
                    return DraftProposal(tuple(draft), "tree", n)
        return NO_DRAFT


class DraftSession:
    """One request's drafting: its context index, its namespace and its :class:`DraftLength`.

    Made by :meth:`Drafter.session`, or directly around a :class:`ContextIndex` the prompt extends (a conversation's
    previous turn, whose tokens are then not indexed again).

    Each decode step: :meth:`propose`, verify the draft, then :meth:`advance` with the tokens the step produced
    and how many of the draft were accepted.
    """

    __slots__ = ("drafter", "index", "length", "namespace")

    def __init__(self, drafter: Drafter, namespace: str | None, index: ContextIndex, length: DraftLength) -> None:
        if index.sizes != drafter.ngram_sizes:
            raise InvalidArgumentError(f"the index has n-gram sizes {index.sizes}, the drafter {drafter.ngram_sizes}")
        self.drafter = drafter
        self.namespace = namespace
        self.length = length
        self.index = index

    @property
    def tokens(self) -> list[int]:
        """The context: prompt and tokens appended since (read only)."""
        return self.index.tokens

    def propose(self) -> DraftProposal:
        """The draft for the next step, of at most the controller's budget (none while it pauses).
        O(sizes + budget)."""
        return self.drafter.lookup(self.index, self.namespace, self.length.next_budget())

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens to the context (the prompt of a conversation's next turn, say) without a verify step."""
        self.index.extend(token_ids)

    def advance(self, token_ids: Sequence[int], num_proposed: int, num_accepted: int) -> None:
        """After a verify step: append the tokens it produced (the accepted draft tokens and the model's own next
        one) and tell the controller how the draft of ``num_proposed`` tokens fared.

        Raises:
            InvalidArgumentError: ``num_accepted`` outside ``0 .. num_proposed``.
        """
        self.length.update(num_proposed, num_accepted)
        self.index.extend(token_ids)
