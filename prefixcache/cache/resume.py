"""Resume points: where a cached prefix can be resumed by a model whose layers carry a recurrent state.

Hybrid models (Qwen3-Next, Nemotron-H, Granite-4.0-H, MiniMax) and pure state-space models (Mamba-2) have layers
that carry a fixed-size state (linear attention, SSM) instead of per-token K/V.  Their KV of a cached prefix is
useless on its own: a request can skip the first ``p`` tokens only if the state of every recurrent layer after those
``p`` tokens was kept.  So the cache keeps opaque *states* at absolute positions of the tree, and a match ends at the
deepest position with a kept state (or at 0, where the initial state needs nothing).  The design follows SGLang's
MambaRadixCache (mamba states on radix nodes, with an LRU list of their own; this store orders them by value) and
vLLM's hybrid KV-cache manager (Mamba state cached at block boundaries).

A state is any object with an ``nbytes: int`` attribute, immutable once handed over: a resuming request copies it,
so states take no locks.  :class:`StateMarker` stands in for callers without tensors (replay, tests).

Layout.  A state at position ``p`` (the state after tokens ``0 .. p - 1``) lives in ``node.states[p]`` of the node
whose edge covers it, ``node.start < p <= node.end``: it needs exactly the KV of that node's tokens up to ``p - 1``
and of the path above.  Splitting a node re-files its states by position, cutting blocks off a leaf's tail drops the
states beyond its new end, removing a node drops its states (:meth:`StateStore.split`, :meth:`StateStore.trim`,
:meth:`StateStore.remove`, called by the tree).  Freeing states never frees KV: after a state is evicted the KV up to
it stays until the KV eviction takes it (as in SGLang), and a later insert may put the state back.

Budget and value.  States live outside the KV pool (the model keeps them on its device), within ``max_bytes`` over
all namespaces.  Putting a state that would exceed it evicts the states of least value first, by GreedyDual-Size-
Frequency (Cao and Irani, "Cost-Aware WWW Proxy Caching Algorithms", 1997; Cherkasova's frequency term, 1998): a
state's priority is ``L + uses * position / nbytes`` — the prefill tokens each resume there saves, per byte kept, times
how often it was resumed — where ``L``, the store's inflation, rises to the priority of each state evicted.  A state
put or resumed now starts from today's ``L``, so recency counts too: a deep state (a long conversation's last answer)
outlives a shallow one put at the same time, a state resumed by many requests (a shared system prompt's) outlives
both, and one that nobody resumes falls behind as ``L`` rises (an order by the owning node's last access alone kept a
state nobody resumed as long as requests passed through its node).  Ties go shallower first, then by node id.  Each
put, resume and eviction costs O(log n) in the number ``n`` of states.

Branch marks (:mod:`prefixcache.cache.marks`) ride on the same hooks: where a request's match is cut back to a kept
state, the cache marks the position it was cut from, and requests prefilling through a marked position keep a state
there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
from sortedcontainers import SortedList

from prefixcache.cache.marks import DEFAULT_MAX_MARKS, BranchMarks
from prefixcache.errors import InvalidArgumentError

if TYPE_CHECKING:
    from array import array

    from prefixcache.cache.node import Node

__all__ = [
    "DEFAULT_STATE_INTERVAL_BLOCKS",
    "RecurrentState",
    "StateMarker",
    "StateStore",
    "check_resume_options",
    "check_state",
    "state_bytes",
]


@runtime_checkable
class RecurrentState(Protocol):
    """What the cache reads from a state: its size in bytes (for the budget)."""

    nbytes: int


DEFAULT_STATE_INTERVAL_BLOCKS = 16
"""Blocks between the states a recurrent model's prefill keeps inside a prompt, by default (the runner's
``state_interval_blocks``, the replay's ``--state-every``): a shared prefix resumes at most this far before its end."""


@dataclass(frozen=True, slots=True)
class StateMarker:
    """A state without tensors: only its size, ``nbytes`` bytes (replay modelling, tests)."""

    nbytes: int


def check_state(state: Any) -> int:
    """The size in bytes of ``state``.

    Raises:
        InvalidArgumentError: ``state`` has no ``nbytes`` attribute, or it is not a non-negative int.
    """
    nbytes = getattr(state, "nbytes", None)
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise InvalidArgumentError(
            f"a recurrent state needs an nbytes attribute holding a non-negative int, got {type(state).__name__} "
            f"with nbytes={nbytes!r}"
        )
    return int(nbytes)


def state_bytes(store: StateStore | None, state: Any) -> int:
    """The bytes of ``state`` handed to a cache keeping states in ``store`` (None: it keeps none); 0 for no state.

    Raises:
        InvalidArgumentError: a state given to a cache that keeps none, or a bad one (see :func:`check_state`).
    """
    if state is None:
        return 0
    if store is None:
        raise InvalidArgumentError("a recurrent state was passed to a cache made without resume_states=True")
    return check_state(state)


def check_resume_options(resume_states: object, max_state_bytes: object, host_tier: bool) -> None:
    """Raises InvalidArgumentError unless the cache options are consistent: ``resume_states`` a bool,
    ``max_state_bytes`` a non-negative int exactly when it is True (there is no unbounded default: the states live on
    the model's device, so the caller sizes them), and no host tier with it (a promoted prefix has no state)."""
    if not isinstance(resume_states, bool):
        raise InvalidArgumentError(f"resume_states must be a bool, got {resume_states!r}")
    if not resume_states:
        if max_state_bytes is not None:
            raise InvalidArgumentError("max_state_bytes is the budget of recurrent states: give resume_states=True")
        return
    if isinstance(max_state_bytes, bool) or not isinstance(max_state_bytes, (int, np.integer)) or max_state_bytes < 0:
        raise InvalidArgumentError(
            f"resume_states=True needs max_state_bytes, a non-negative int of bytes, got {max_state_bytes!r}"
        )
    if host_tier:
        raise InvalidArgumentError(
            "a model with recurrent layers (a cache with resume_states) cannot use a host-memory tier "
            "(host_cache_tokens / --host-cache-tokens): a prefix promoted from host memory has no recurrent state"
        )


class StateStore:
    """The states kept on the tree's nodes, their byte total within ``max_bytes`` and their order of value, and the
    branch marks (``marks``, :class:`~prefixcache.cache.marks.BranchMarks`, at most ``max_marks``).

    Counters: ``num_bytes`` (bytes of the states kept), ``evicted`` (states evicted by the budget), ``dropped`` (states
    not kept: larger than the whole budget, or at a position the tree does not hold), ``kv_freed`` (states freed with
    their node's KV), ``shortfall_tokens`` (tokens that matched but could not be resumed, counted by admission),
    ``inflation`` (the priority of the last state evicted, ``L`` in the module docstring).
    """

    def __init__(self, max_bytes: int, max_marks: int = DEFAULT_MAX_MARKS) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.evicted = 0
        self.dropped = 0
        self.kv_freed = 0
        self.shortfall_tokens = 0
        self.inflation = 0.0
        self.marks = BranchMarks(max_marks)
        # (priority, position, node id) for each state, lowest value first.
        self._order: SortedList = SortedList()
        # (node id, position) -> (priority it is filed under, nbytes measured when it was put, resumes + 1)
        self._filed: dict[tuple[int, int], tuple[float, int, int]] = {}
        self._nodes: dict[int, Node] = {}  # the nodes holding states, by id

    def __len__(self) -> int:
        return len(self._filed)

    def _priority(self, pos: int, nbytes: int, uses: int) -> float:
        return self.inflation + uses * pos / max(nbytes, 1)

    # ---- put and find -------------------------------------------------------------------------------------

    def put(self, node: Node, pos: int, state: Any, nbytes: int, uses: int | None = None) -> bool:
        """Keep ``state`` (``nbytes`` bytes) at position ``pos`` of ``node`` (``node.start < pos <= node.end``),
        replacing a state kept there (its resumes carried over, unless ``uses`` is given: a restored state's), after
        evicting the states of least value until it fits.  A state larger than the whole budget is not kept (counted
        in ``dropped``).  Returns whether it was kept.  O(log n) per state stored or evicted."""
        if nbytes > self.max_bytes:
            self.dropped += 1
            return False
        carried = 1
        if node.states is not None and pos in node.states:
            carried = self._filed[(node.node_id, pos)][2]
            self._discard(node, pos)
        uses = carried if uses is None else max(int(uses), 1)
        while self.num_bytes + nbytes > self.max_bytes:
            self._evict_one()
        if node.states is None:
            node.states = {}
            self._nodes[node.node_id] = node
        node.states[pos] = state
        priority = self._priority(pos, nbytes, uses)
        self._filed[(node.node_id, pos)] = (priority, nbytes, uses)
        self._order.add((priority, pos, node.node_id))
        self.num_bytes += nbytes
        return True

    def filed(self, node: Node, pos: int) -> tuple[int, int]:
        """``(nbytes, uses)`` of the state kept at ``pos`` on ``node`` (``uses``: resumes + 1).  O(1).  KeyError when
        none is kept there."""
        _, nbytes, uses = self._filed[(node.node_id, pos)]
        return nbytes, uses

    def resumed(self, node: Node, pos: int) -> None:
        """A request resumes at the state kept at ``pos`` on the path to ``node``: one more use, its priority renewed
        from today's inflation.  O(depth + log n)."""
        holder = _holder(node, pos)
        key = (holder.node_id, pos)
        filed = self._filed.get(key)
        if filed is None:
            return
        priority, nbytes, uses = filed
        self._order.remove((priority, pos, holder.node_id))
        fresh = self._priority(pos, nbytes, uses + 1)
        self._filed[key] = (fresh, nbytes, uses + 1)
        self._order.add((fresh, pos, holder.node_id))

    def resumable(self, tree: Any, q: array, namespace: str | None, match: Any, owner: object) -> Any:
        """``match`` (a :class:`~prefixcache.cache.results.MatchResult` of ``tree``) cut back to the deepest kept
        state on its path (a new, untouching match), counting the tokens cut off in ``shortfall_tokens`` and the
        resume in the state's value.  O(depth) plus a second match when it is cut."""
        resume_at = self.deepest(match.node, match.num_tokens)[0]
        if resume_at:
            self.resumed(match.node, resume_at)
        if resume_at == match.num_tokens:
            return match
        self.shortfall_tokens += match.num_tokens - resume_at
        return tree.match(q, namespace, resume_at, owner, touch=False)

    def stats(self) -> dict[str, int]:
        """The :class:`~prefixcache.cache.stats.CacheStats` fields of the states.  O(1)."""
        return {
            "resume_shortfall_tokens": self.shortfall_tokens,
            "num_states": len(self._filed),
            "state_bytes": self.num_bytes,
            "max_state_bytes": self.max_bytes,
            "evicted_states": self.evicted,
            "dropped_states": self.dropped,
            "kv_evicted_states": self.kv_freed,
            "num_branch_marks": len(self.marks),
        }

    def drop(self) -> None:
        """Count a state that was not kept because the tree does not hold its position."""
        self.dropped += 1

    @staticmethod
    def deepest(node: Node, limit: int) -> tuple[int, Any]:
        """``(p, state)``: the deepest position ``p <= limit`` with a kept state on the path from the root to
        ``node``, or ``(0, None)``.  O(depth) plus the states on the first node from the bottom that has one at or
        below ``limit``."""
        while node.parent is not None:
            states = node.states
            if states is not None:
                best = max((p for p in states if p <= limit), default=0)
                if best:
                    return best, states[best]
            node = node.parent
        return 0, None

    @staticmethod
    def positions(node: Node, limit: int) -> list[int]:
        """Every position ``<= limit`` with a kept state on the path to ``node``, ascending.  O(depth + states)."""
        out: list[int] = []
        while node.parent is not None:
            if node.states is not None:
                out.extend(p for p in node.states if p <= limit)
            node = node.parent
        return sorted(out)

    # ---- the tree's hooks (states and marks) --------------------------------------------------------------

    def split(self, lower: Node, upper: Node) -> None:
        """``upper`` was cut off the top of ``lower``: move the states and marks it now covers (``p <= upper.end``)
        to it, states filed under the same priority.  O(k log n) for the k states moved."""
        if lower.marks is not None:
            self.marks.split(lower, upper)
        if lower.states is None:
            return
        for pos in [p for p in lower.states if p <= upper.end]:
            state = lower.states[pos]
            filed = self._unfile(lower, pos)
            if upper.states is None:
                upper.states = {}
                self._nodes[upper.node_id] = upper
            upper.states[pos] = state
            self._filed[(upper.node_id, pos)] = filed
            self._order.add((filed[0], pos, upper.node_id))

    def trim(self, node: Node) -> None:
        """``node``'s edge was shortened: free the states beyond its new end (``kv_freed``), drop the marks there."""
        if node.marks is not None:
            self.marks.trim(node)
        if node.states is None:
            return
        for pos in [p for p in node.states if p > node.end]:
            self._discard(node, pos)
            self.kv_freed += 1

    def remove(self, node: Node) -> None:
        """``node`` left the tree: free all its states (``kv_freed``) and marks."""
        if node.marks is not None:
            self.marks.remove(node)
        if node.states is None:
            return
        for pos in list(node.states):
            self._discard(node, pos)
            self.kv_freed += 1

    # ---- internals ----------------------------------------------------------------------------------------

    def _unfile(self, node: Node, pos: int) -> tuple[float, int, int]:
        filed = self._filed.pop((node.node_id, pos))
        self._order.remove((filed[0], pos, node.node_id))
        del node.states[pos]
        if not node.states:
            node.states = None
            del self._nodes[node.node_id]
        return filed

    def _discard(self, node: Node, pos: int) -> None:
        self.num_bytes -= self._unfile(node, pos)[1]

    def _evict_one(self) -> None:
        priority, pos, node_id = self._order[0]
        self.inflation = max(self.inflation, priority)
        self._discard(self._nodes[node_id], pos)
        self.evicted += 1

    # ---- checks -------------------------------------------------------------------------------------------

    def check(self, nodes: list[Node]) -> None:
        """``nodes`` are all the tree's nodes: every state sits at a position its node covers, each is filed once
        under a tick no later than its node's access time, and the byte total is the sum.  O(n log n).

        Raises:
            AssertionError: naming the first broken invariant.
        """
        seen: set[tuple[int, int]] = set()
        total = 0
        for node in nodes:
            if node.states is None:
                if node.node_id in self._nodes and self._nodes[node.node_id] is node:
                    raise AssertionError(f"node {node.node_id} holds no states but the store lists it")
                continue
            if not node.states or self._nodes.get(node.node_id) is not node:
                raise AssertionError(f"node {node.node_id} holds states the store does not list (or an empty dict)")
            for pos in node.states:
                if not node.start < pos <= node.end:
                    raise AssertionError(f"node {node.node_id} ({node.start}..{node.end}) keeps a state at {pos}")
                filed = self._filed.get((node.node_id, pos))
                if filed is None:
                    raise AssertionError(f"the state at {pos} on node {node.node_id} is not filed")
                priority, nbytes, uses = filed
                if uses < 1 or (priority, pos, node.node_id) not in self._order:
                    raise AssertionError(f"the state at {pos} on node {node.node_id} is filed under a wrong key")
                seen.add((node.node_id, pos))
                total += nbytes
        if len(seen) != len(self._filed) or len(self._order) != len(self._filed):
            raise AssertionError(f"{len(self._filed)} states filed, {len(seen)} on the tree's nodes")
        if len(self._nodes) != len({node_id for node_id, _ in seen}):
            raise AssertionError("the store lists nodes that are not in the tree")
        if total != self.num_bytes:
            raise AssertionError(f"state bytes {self.num_bytes} != {total}, the sum of the states kept")
        if total > self.max_bytes:
            raise AssertionError(f"{total} state bytes exceed the budget of {self.max_bytes}")
        self.marks.check(nodes)


def _holder(node: Node, pos: int) -> Node:
    """The node on the path to ``node`` whose edge covers position ``pos`` (``start < pos <= end``)."""
    while node.parent is not None and node.start >= pos:
        node = node.parent
    return node
