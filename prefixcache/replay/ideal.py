"""The ideal cache: what an infinite prefix cache would hit, computed without the radix tree.

The replay report compares the tree's hits with this figure, so it must come from an independent method.  It
keeps every sequence seen so far in lexicographic order (a ``sortedcontainers.SortedList`` of big-endian uint32
bytes, whose byte order is the token order).  The longest common prefix of a query with *any* stored sequence
is the longest common prefix with one of its two neighbours in that order, so each query costs O(log n) plus
one vectorized comparison per neighbour.
"""

from __future__ import annotations

import sys
from array import array

import numpy as np
from sortedcontainers import SortedList

from prefixcache.cache.tokens import TOKEN_TYPECODE


def _key(token_ids: array) -> bytes:
    ids = array(TOKEN_TYPECODE, token_ids)
    if sys.byteorder == "little":
        ids.byteswap()
    return ids.tobytes()


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Longest common prefix, in tokens, of two keys (big-endian uint32 bytes)."""
    n = min(len(a), len(b)) // 4
    if n == 0:
        return 0
    x = np.frombuffer(a, dtype=">u4", count=n)
    y = np.frombuffer(b, dtype=">u4", count=n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class IdealCache:
    """An unbounded cache of token sequences answering longest-common-prefix queries.

    Memory: 4 bytes per stored token.  :meth:`lookup` O(log n + len), :meth:`add` O(log n + len).
    """

    def __init__(self) -> None:
        self._keys: SortedList = SortedList()
        self.num_tokens = 0

    def lookup(self, token_ids: array) -> int:
        """Tokens of ``token_ids`` that some stored sequence starts with (longest common prefix)."""
        key = _key(token_ids)
        keys = self._keys
        i = keys.bisect_left(key)
        best = 0
        if i < len(keys):
            best = common_prefix_tokens(key, keys[i])
        if i > 0:
            best = max(best, common_prefix_tokens(key, keys[i - 1]))
        return best

    def add(self, token_ids: array) -> None:
        """Store a sequence (no-op if already stored)."""
        key = _key(token_ids)
        keys = self._keys
        i = keys.bisect_left(key)
        if i < len(keys) and keys[i] == key:
            return
        keys.add(key)
        self.num_tokens += len(token_ids)
