"""Branch marks: positions of the tree where a recurrent model's state is worth keeping, learnt from the requests.

A cache of a recurrent (hybrid or state-space) model resumes a prefix only where a state is kept
(:mod:`prefixcache.cache.resume`).  Where two requests part ways inside a cached sequence — many conversations behind
one system prompt, an edited message, a regenerated answer — the first one to part there has no state to resume at
the branch: its match is cut back to the deepest kept state.  The cache then *marks* the branch position on the tree
(only where the cached sequence goes on past it: a request extending the end of a sequence whose state was evicted
is no branch, and the state it keeps at its own end serves the next turn),
and any request whose prefill passes through a marked position keeps a state there (:attr:`Lease.state_points
<prefixcache.cache.lease.Lease>`): the request that marks keeps it itself, so from the next one on the whole shared
prefix resumes.  SGLang's MambaRadixCache and vLLM's hybrid manager keep Mamba states at fixed block boundaries only;
this follows the idea of placing checkpoints where the tree branches (as a radix tree splits a node there).

Layout.  A mark at position ``p`` lives in ``node.marks`` of the node whose edge covers it (``node.start < p <=
node.end``), as a state does; splitting a node re-files its marks, trimming a leaf drops the marks beyond its new end,
removing a node drops its marks (:meth:`BranchMarks.split`, :meth:`BranchMarks.trim`, :meth:`BranchMarks.remove`, called
by :class:`~prefixcache.cache.resume.StateStore`'s hooks).  At most ``max_marks`` marks are kept over all namespaces; a
new one drops the oldest (first in, first out; marking a position again makes it the newest).  A mark costs a dict
entry, no tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixcache.errors import InvalidArgumentError

if TYPE_CHECKING:
    from prefixcache.cache.node import Node

__all__ = ["DEFAULT_MAX_MARKS", "BranchMarks"]

DEFAULT_MAX_MARKS = 4096
"""Marks kept at most by default: a few hundred KB of dict entries, far more branch points than a state budget keeps
states for."""


class BranchMarks:
    """The marked positions on the tree's nodes, at most ``max_marks`` of them, oldest dropped first.

    Counters: ``made`` (marks made, a position marked again counting once more), ``dropped`` (marks dropped to stay
    within ``max_marks``).

    Raises:
        InvalidArgumentError: ``max_marks`` is not a non-negative int (0: nothing is marked).
    """

    def __init__(self, max_marks: int = DEFAULT_MAX_MARKS) -> None:
        if isinstance(max_marks, bool) or not isinstance(max_marks, int) or max_marks < 0:
            raise InvalidArgumentError(f"max_marks must be a non-negative int, got {max_marks!r}")
        self.max_marks = max_marks
        self.made = 0
        self.dropped = 0
        # serial -> (node, position), oldest first (dicts keep insertion order); node.marks maps position -> serial.
        self._marks: dict[int, tuple[Node, int]] = {}
        self._serial = 0

    def __len__(self) -> int:
        return len(self._marks)

    def mark(self, node: Node, pos: int) -> None:
        """Mark position ``pos`` of ``node`` (``node.start < pos <= node.end``), the newest mark; drops the oldest
        beyond ``max_marks``.  O(1)."""
        if not self.max_marks:
            return
        self.made += 1
        if node.marks is None:
            node.marks = {}
        elif pos in node.marks:
            del self._marks[node.marks[pos]]  # filed again below: the newest
        self._serial += 1
        node.marks[pos] = self._serial
        self._marks[self._serial] = (node, pos)
        while len(self._marks) > self.max_marks:
            holder, oldest = next(iter(self._marks.values()))
            self._drop(holder, oldest)
            self.dropped += 1

    @staticmethod
    def between(node: Node, lo: int, hi: int) -> tuple[int, ...]:
        """The marked positions ``lo < p <= hi`` on the path from the root to ``node``, ascending.  O(depth + marks
        on it)."""
        out: list[int] = []
        while node.parent is not None and node.end > lo:
            if node.marks is not None:
                out.extend(p for p in node.marks if lo < p <= hi)
            node = node.parent
        return tuple(sorted(out))

    # ---- the tree's hooks (through the state store) ---------------------------------------------------------

    def split(self, lower: Node, upper: Node) -> None:
        """``upper`` was cut off the top of ``lower``: move the marks it now covers to it, keeping their age.  O(k) for
        the k marks moved."""
        for pos in [p for p in lower.marks if p <= upper.end]:
            serial = lower.marks.pop(pos)
            if upper.marks is None:
                upper.marks = {}
            upper.marks[pos] = serial
            self._marks[serial] = (upper, pos)
        if not lower.marks:
            lower.marks = None

    def trim(self, node: Node) -> None:
        """``node``'s edge was shortened: drop the marks beyond its new end."""
        for pos in [p for p in node.marks if p > node.end]:
            self._drop(node, pos)

    def remove(self, node: Node) -> None:
        """``node`` left the tree: drop its marks."""
        for pos in list(node.marks):
            self._drop(node, pos)

    def _drop(self, node: Node, pos: int) -> None:
        del self._marks[node.marks.pop(pos)]
        if not node.marks:
            node.marks = None

    def check(self, nodes: list[Node]) -> None:
        """``nodes`` are all the tree's nodes: every mark sits at a position its node covers and is listed once, and
        there are at most ``max_marks``.  O(n + marks).

        Raises:
            AssertionError: naming the first broken invariant.
        """
        seen = 0
        for node in nodes:
            if node.marks is None:
                continue
            if not node.marks:
                raise AssertionError(f"node {node.node_id} holds an empty dict of marks")
            for pos, serial in node.marks.items():
                if not node.start < pos <= node.end:
                    raise AssertionError(f"node {node.node_id} ({node.start}..{node.end}) marks {pos}")
                held = self._marks.get(serial)
                if held is None or held[0] is not node or held[1] != pos:
                    raise AssertionError(f"the mark at {pos} on node {node.node_id} is not listed")
                seen += 1
        if seen != len(self._marks):
            raise AssertionError(f"{len(self._marks)} marks listed, {seen} on the tree's nodes")
        if seen > self.max_marks:
            raise AssertionError(f"{seen} marks exceed the bound of {self.max_marks}")
