"""The lease: a request's hold on the cache, from the match of its prompt to the insert of what it computed.

A :class:`Lease` is a record that :mod:`~prefixcache.cache.admission` makes and changes and
:mod:`~prefixcache.cache.handover` extends; callers only read it and hand it back to
:class:`~prefixcache.RadixCache`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from prefixcache.cache.locks import LockHandle


@dataclass(slots=True, eq=False)
class Lease:
    """A request's hold on the cache, from :meth:`~prefixcache.RadixCache.acquire` to
    :meth:`~prefixcache.RadixCache.commit` or :meth:`~prefixcache.RadixCache.release`.

    ``block_table[:first_owned_block]`` are the tree's blocks of the matched prefix (kept alive by ``lock``);
    ``block_table[first_owned_block:]`` are owned by the request (the copy-on-write block of a match ending inside
    a block, then the blocks for the tokens it computes).  ``num_cached_tokens`` prompt tokens need no prefill;
    ``num_copied_tokens`` of them were copied rather than shared, ``num_host_tokens`` of them were promoted from the
    host-memory tier (:mod:`prefixcache.cache.host.tier`) for this request.

    ``num_matched_tokens`` is the longest token match (at most ``len - 1`` prompt tokens).  In a cache that resumes
    recurrent states (:mod:`prefixcache.cache.resume`) the request resumes from ``resume_state``, the state kept at
    position ``num_cached_tokens`` (None at 0: the initial state), and ``resume_shortfall_tokens`` of the matched
    tokens could not be resumed (no state kept at or after them).  Then ``num_cached_tokens == num_matched_tokens -
    resume_shortfall_tokens``, except where copy-on-write found no block: the request then resumes at the deepest
    state at a block boundary.  ``state_points`` are the branch marks (:mod:`prefixcache.cache.marks`) between the
    resume point and the match's end, ascending: the request should keep a state at each as its prefill passes it
    (:meth:`~prefixcache.RadixCache.put_state`).  Without resume states ``resume_state`` is None, the shortfall 0 and
    ``state_points`` empty.
    """

    token_ids: array
    namespace: str | None
    num_cached_tokens: int
    num_copied_tokens: int
    block_table: np.ndarray
    first_owned_block: int
    lock: LockHandle
    block_size: int
    closed: bool = False
    request_id: str | None = None
    # False once the blocks from first_owned_block on are handed to the tree or freed; the lock may still be held.
    owns_blocks: bool = True
    num_host_tokens: int = 0
    num_matched_tokens: int = 0
    resume_state: object | None = None
    resume_shortfall_tokens: int = 0
    state_points: tuple[int, ...] = ()

    @property
    def capacity_tokens(self) -> int:
        """Tokens the block table can address: ``len(block_table) * block_size``."""
        return len(self.block_table) * self.block_size

    def extend_prompt(self, q: array) -> None:
        """After ``q`` went to the tree with the lease kept open (:meth:`~prefixcache.RadixCache.insert_prefix`):
        tokens beyond a shorter acquired prompt (a resumed request matches a prefix of what it knows) become the
        lease's prompt, so that :meth:`~prefixcache.RadixCache.put_state` reaches them.  O(1)."""
        if len(q) > len(self.token_ids):
            self.token_ids = q
