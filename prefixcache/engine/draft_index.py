"""The n-gram indexes a drafter looks up: one over a request's own tokens, one over a namespace's cached blocks.

Both map an n-gram (the ``n`` tokens before a position) to the latest position it was seen before, so that the tokens
from that position on can be proposed as the continuation.  Keys are 64-bit polynomial hashes of the n-gram
(``h = (h * M + t) mod 2**64`` over its tokens), computed with NumPy for long runs and in Python for a few tokens;
every hit is checked against the tokens themselves, so a hash collision costs a miss, never a wrong n-gram.

:class:`ContextIndex` holds one request's context (prompt and tokens generated so far) and grows with it.
:class:`BlockTree` mirrors the full blocks a :class:`~prefixcache.cache.radix_cache.RadixCache` holds in one
namespace, as its KV events announce them (:mod:`prefixcache.cache.events`): each block in a slot of ``block_size``
tokens, linked to its parent block, and a continuation runs on from a block into its most recently stored child,
as the tree's branches go.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import numpy as np

from prefixcache.errors import InvalidArgumentError

__all__ = [
    "BlockTree",
    "ContextIndex",
    "SharedPrefix",
    "latest_matches",
    "ngram_hashes_before",
    "suffix_hashes",
]

_MULT = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_MULT_U64 = np.uint64(_MULT)
_POWERS = [pow(_MULT, i, 1 << 64) for i in range(64)]

VECTOR_MIN_TOKENS = 48
"""From this many new tokens on, an index is extended with NumPy (about 15 us plus 40 ns a key) rather than a Python
loop (about 250 ns a key)."""


def _hash_runs(tokens: np.ndarray, max_n: int) -> list[np.ndarray]:
    """``out[n - 1][j]``: the hash of ``tokens[j : j + n]``, for ``n`` in ``1 .. max_n``; ``tokens`` uint64."""
    out = [tokens]
    h = tokens
    for n in range(2, max_n + 1):
        h = h[:-1] * _MULT_U64 + tokens[n - 1 :]
        out.append(h)
    return out


def _ngram_hashes(tokens: Sequence[int], end: int, max_n: int) -> list[int]:
    """The hashes of the ``1 .. max_n`` tokens ending before ``tokens[end]`` (fewer when ``end < max_n``)."""
    hashes = []
    h = 0
    for n in range(1, min(max_n, end) + 1):
        h = (tokens[end - n] * _POWERS[n - 1] + h) & _MASK
        hashes.append(h)
    return hashes


def suffix_hashes(tokens: Sequence[int], max_n: int) -> list[int]:
    """``out[n - 1]``: the hash of the last ``n`` tokens, for ``n`` in ``1 .. min(max_n, len(tokens))``.  O(max_n)."""
    return _ngram_hashes(tokens, len(tokens), max_n)


def ngram_hashes_before(tokens: np.ndarray, positions: np.ndarray, n: int) -> np.ndarray:
    """The hashes (as :func:`suffix_hashes`) of the ``n`` tokens before each of ``positions`` (all ``>= n``) in
    ``tokens`` (int64).  O(len(positions) x n) with NumPy."""
    keys = np.zeros(len(positions), dtype=np.uint64)
    for j in range(n, 0, -1):
        keys = keys * _MULT_U64 + tokens[positions - j].astype(np.uint64)
    return keys


def _int_array(token_ids: Iterable[int]) -> np.ndarray:
    """``token_ids`` as a 1-D int64 array (an ``array('I')`` or ndarray converted at C speed)."""
    if isinstance(token_ids, (np.ndarray, array)):
        return np.asarray(token_ids).astype(np.int64, copy=False)
    return np.asarray(list(token_ids), dtype=np.int64).reshape(-1)


class SharedPrefix:
    """A static n-gram index of a token sequence many contexts start with (a system prompt and its tools), read by
    each :class:`ContextIndex` that shares a prefix of it instead of indexing those tokens again.

    Per n-gram size, the positions ``p`` (``n <= p < len``) sorted by (hash of ``tokens[p - n : p]``, ``p``), so that
    a context sharing only the first ``T`` tokens gets the latest position before ``T`` of each n-gram in one O(len)
    NumPy pass (:meth:`table`).  Built in O(len x log(len) x sizes) with NumPy; memory 16 bytes a position and size.
    """

    __slots__ = ("_keys", "_positions", "max_n", "sizes", "tokens")

    def __init__(self, ngram_sizes: Sequence[int], token_ids: Iterable[int]) -> None:
        self.sizes = tuple(ngram_sizes)
        self.max_n = max(self.sizes)
        self.tokens = _int_array(token_ids)
        runs = _hash_runs(self.tokens.astype(np.uint64), self.max_n)
        self._keys: dict[int, np.ndarray] = {}
        self._positions: dict[int, np.ndarray] = {}
        for n in self.sizes:
            keys = runs[n - 1][: max(0, len(self.tokens) - n)]  # keys[j]: the n-gram before position j + n
            order = np.argsort(keys, kind="stable")
            self._keys[n] = keys[order]
            self._positions[n] = order + n

    def __len__(self) -> int:
        return len(self.tokens)

    def common_prefix(self, tokens: np.ndarray) -> int:
        """How many first tokens ``tokens`` (int64) shares with this prefix.  O(that many) with NumPy."""
        m = min(len(tokens), len(self.tokens))
        differ = np.flatnonzero(tokens[:m] != self.tokens[:m])
        return int(differ[0]) if len(differ) else m

    def table(self, n: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The sorted distinct hashes of the ``n``-grams before positions ``n .. length - 1`` and the latest such
        position of each.  O(len) with NumPy."""
        positions = self._positions[n]
        keep = positions < length
        keys, positions = self._keys[n][keep], positions[keep]
        last = np.ones(len(keys), dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]  # positions rise within a hash: its last entry is its latest
        return keys[last], positions[last]


def latest_matches(
    tokens: np.ndarray, n: int, queries: np.ndarray, shared: SharedPrefix | None = None, shared_tokens: int = 0
) -> np.ndarray:
    """For each position ``q`` in ``queries`` (int64), the position a :class:`ContextIndex` holding ``tokens[:q]``
    would draft from with its last ``n`` tokens (:meth:`ContextIndex.lookup`): the latest ``p < q`` (``p >= n``)
    whose ``n`` tokens before equal those before ``q``, -1 for none.  ``tokens`` (int64) starts with the first
    ``shared_tokens`` of ``shared``, read from its table; every query must be at ``shared_tokens`` or later.  Every
    query of a whole conversation at once: O(len(tokens) x log) with NumPy.
    """
    found = np.full(len(queries), -1, dtype=np.int64)
    first = max(shared_tokens, n)
    end = len(tokens)
    if first >= end or not len(queries):
        return found
    keys = _hash_runs(tokens[first - n : end].astype(np.uint64), n)[n - 1][: end - first]  # before first .. end - 1
    # The latest earlier position past the shared prefix with the same n-gram: the one before in a stable sort.
    order = np.argsort(keys, kind="stable")
    same = np.flatnonzero(keys[order[1:]] == keys[order[:-1]])
    previous = np.full(len(keys), -1, dtype=np.int64)
    previous[order[same + 1]] = order[same] + first
    asked = np.flatnonzero(queries >= first)
    found[asked] = previous[queries[asked] - first]
    if shared is not None and shared_tokens:
        missing = asked[found[asked] < 0]
        table_keys, table_positions = shared.table(n, shared_tokens)
        if len(missing) and len(table_keys):
            wanted = keys[queries[missing] - first]
            at = np.minimum(np.searchsorted(table_keys, wanted), len(table_keys) - 1)
            found[missing] = np.where(table_keys[at] == wanted, table_positions[at], -1)
    # Check each match against the tokens themselves: a hash collision is a miss, as in lookup.
    hit = np.flatnonzero(found >= 0)
    p, q = found[hit], queries[hit]
    ok = np.ones(len(hit), dtype=bool)
    for j in range(1, n + 1):
        ok &= tokens[p - j] == tokens[q - j]
    found[hit[~ok]] = -1
    return found


class ContextIndex:
    """One request's tokens and, per n-gram size, where each n-gram last stood with a token after it.

    ``tokens`` is a list of ints (and ``array`` the same tokens in an int64 NumPy array); position ``p``
    (``n <= p < len(tokens)``) is indexed under the n-gram ``tokens[p - n : p]``, later positions replacing earlier
    ones.  With a ``shared`` prefix, the positions before ``shared_tokens`` (the tokens the context has in common with
    it) are read from the prefix's table instead of being indexed again.  ``tail`` holds the hashes of the last
    ``1 .. max_n`` tokens (what a lookup asks for).  Memory: one dict entry per distinct n-gram and size past the
    shared prefix (about 100 bytes each), 16 bytes a shared position and size.
    """

    __slots__ = ("_buf", "_by_n", "_maps", "_shared", "max_n", "shared_tokens", "sizes", "tail", "tokens")

    def __init__(
        self, ngram_sizes: Sequence[int], token_ids: Iterable[int] = (), *, shared: SharedPrefix | None = None
    ) -> None:
        self.sizes = tuple(ngram_sizes)
        self.max_n = max(self.sizes)
        self.tokens: list[int] = []
        self.tail: list[int] = []
        self._buf = np.zeros(64, dtype=np.int64)
        self._maps: dict[int, dict[int, int]] = {n: {} for n in self.sizes}
        self._by_n = [self._maps.get(n) for n in range(1, self.max_n + 1)]
        self._shared: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
        self.shared_tokens = 0
        new = _int_array(token_ids)
        if shared is not None:
            if shared.sizes != self.sizes:
                raise InvalidArgumentError(f"the shared prefix has n-gram sizes {shared.sizes}, not {self.sizes}")
            self.shared_tokens = shared.common_prefix(new)
            if self.shared_tokens:
                self._shared = {n: shared.table(n, self.shared_tokens) for n in self.sizes}
        self._append(new)
        self._index_vector(self.shared_tokens, len(self.tokens))
        self.tail = suffix_hashes(self.tokens, self.max_n)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def array(self) -> np.ndarray:
        """The tokens as an int64 array (a view: read only, valid until the next append)."""
        return self._buf[: len(self.tokens)]

    def _append(self, new: np.ndarray) -> None:
        start, end = len(self.tokens), len(self.tokens) + len(new)
        if end > len(self._buf):
            grown = np.zeros(max(end, 2 * len(self._buf)), dtype=np.int64)
            grown[:start] = self._buf[:start]
            self._buf = grown
        self._buf[start:end] = new
        self.tokens.extend(new.tolist())

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens and index the positions they complete.  O(new tokens x sizes): about 0.3 us a key in Python,
        40 ns with NumPy from :data:`VECTOR_MIN_TOKENS` new tokens on (measured unloaded)."""
        new = _int_array(token_ids)
        if len(new) >= VECTOR_MIN_TOKENS:
            start = len(self.tokens)
            self._append(new)
            self._index_vector(start, len(self.tokens))
            self.tail = suffix_hashes(self.tokens, self.max_n)
            return
        for token in new.tolist():
            self.push(token)

    def push(self, token: int) -> None:
        """Append one token.  O(sizes)."""
        tokens, tail = self.tokens, self.tail
        p = len(tokens)
        for index, h in zip(self._by_n, tail, strict=False):
            if index is not None:
                index[h] = p
        if p == len(self._buf):
            self._buf = np.concatenate([self._buf, np.zeros(p, dtype=np.int64)])
        self._buf[p] = token
        tokens.append(token)
        # The hash of the last n tokens is the hash of the n - 1 before the new one, times M, plus it.
        self.tail = [token] + [(h * _MULT + token) & _MASK for h in tail[: self.max_n - 1]]

    def _runs(self, start: int, end: int) -> tuple[int, list[np.ndarray]]:
        low = max(0, start - self.max_n)
        return low, _hash_runs(self._buf[low:end].astype(np.uint64), self.max_n)

    def _index_vector(self, start: int, end: int) -> None:
        if start >= end:
            return
        low, runs = self._runs(start, end)
        for n in self.sizes:
            first = max(start, n)
            if first >= end:
                continue
            # The n-gram ending before position p starts at p - n, index p - n - low of the run.
            keys = runs[n - 1][first - n - low : end - n - low]
            self._maps[n].update(zip(keys.tolist(), range(first, end), strict=True))

    def _shared_latest(self, n: int, keys: np.ndarray) -> np.ndarray:
        """The latest shared position of each n-gram hash in ``keys`` (-1: none).  O(len(keys) x log) with NumPy."""
        table_keys, table_positions = self._shared[n]  # type: ignore[index]
        if not len(table_keys):
            return np.full(len(keys), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(table_keys, keys), len(table_keys) - 1)
        return np.where(table_keys[at] == keys, table_positions[at], -1)

    def lookup(self, n: int, num_tokens: int) -> list[int] | None:
        """The up to ``num_tokens`` tokens that followed the latest earlier occurrence of the context's last ``n``
        tokens, or None.  O(n + num_tokens), and a binary search of the shared prefix's table when the n-gram is
        not seen past it."""
        if n > len(self.tail):
            return None
        h = self.tail[n - 1]
        p = self._maps[n].get(h)
        if p is None:
            if self._shared is None:
                return None
            p = int(self._shared_latest(n, np.array([h], dtype=np.uint64))[0])
            if p < 0:
                return None
        tokens = self.tokens
        if tokens[p - n : p] != tokens[len(tokens) - n :]:
            return None
        return tokens[p : p + num_tokens]


class BlockTree:
    """The full blocks of one namespace, kept as the KV events of the cache announce them, indexed by n-gram.

    Block ``s`` (a slot) holds ``block_size`` tokens at ``log[s * block_size :]``, the ``max_n`` tokens before it
    (its ``lead``, empty at a sequence's start), its parent's slot and its children's slots in the order they were
    stored.  Each of its positions is indexed under the n-grams ending there; a removed block takes its index entries
    with it (an n-gram seen only there is then a miss until stored again).  With ``keys`` (per size, the sorted
    distinct n-gram hashes that will be looked up), only those n-grams are indexed.  Memory: ``block_size`` tokens
    and up to ``block_size x sizes`` dict entries a block.
    """

    __slots__ = ("_children", "_free", "_hash", "_keys", "_lead", "_log", "_maps", "_media", "_parent", "_slot",
                 "block_size", "max_n", "sizes")  # fmt: skip

    def __init__(self, block_size: int, ngram_sizes: Sequence[int], keys: dict[int, np.ndarray] | None = None) -> None:
        self.block_size = block_size
        self._keys = keys
        self.sizes = tuple(ngram_sizes)
        self.max_n = max(self.sizes)
        self._log: list[int] = []
        self._slot: dict[int, int] = {}
        self._hash: list[int | None] = []
        self._parent: list[int] = []
        self._children: list[dict[int, None]] = []
        self._lead: list[list[int]] = []
        self._media: list[set[str | None]] = []
        self._free: list[int] = []
        self._maps: dict[int, dict[int, int]] = {n: {} for n in self.sizes}

    @property
    def num_blocks(self) -> int:
        """Blocks held."""
        return len(self._slot)

    def store(
        self, block_hashes: Sequence[int], parent_hash: int, token_ids: Sequence[int], medium: str | None = None
    ) -> int:
        """Add blocks as a ``BlockStored`` event gives them: ``block_hashes[i]`` names
        ``token_ids[i * block_size : (i + 1) * block_size]``, the first one's parent is ``parent_hash``.  A block
        already held (in another medium) is only marked held there too.  Returns the blocks added.
        O(tokens x sizes), with NumPy."""
        bs = self.block_size
        new: list[tuple[int, int]] = []  # (event block index, slot)
        previous = parent_hash
        for i, h in enumerate(block_hashes):
            slot = self._slot.get(h)
            if slot is not None:
                self._media[slot].add(medium)
                previous = h
                continue
            parent = self._slot.get(previous, -1)
            slot = self._new_slot(h, parent, token_ids[i * bs : (i + 1) * bs], medium)
            new.append((i, slot))
            previous = h
        if new:
            self._index(new, token_ids)
        return len(new)

    def _new_slot(self, block_hash: int, parent: int, tokens: Sequence[int], medium: str | None) -> int:
        bs = self.block_size
        keep = self.max_n
        lead: list[int] = []
        if parent >= 0 and keep:
            lead = (self._lead[parent] + self._log[parent * bs : (parent + 1) * bs])[-keep:]
        if self._free:
            slot = self._free.pop()
            self._log[slot * bs : (slot + 1) * bs] = tokens
            self._hash[slot], self._parent[slot], self._lead[slot] = block_hash, parent, lead
            self._children[slot] = {}
            self._media[slot] = {medium}
        else:
            slot = len(self._hash)
            self._log.extend(tokens)
            self._hash.append(block_hash)
            self._parent.append(parent)
            self._lead.append(lead)
            self._children.append({})
            self._media.append({medium})
        self._slot[block_hash] = slot
        if parent >= 0:
            self._children[parent][slot] = None
        return slot

    def _index(self, new: list[tuple[int, int]], token_ids: Sequence[int]) -> None:
        """Index the positions of the ``new`` blocks of one event, in one NumPy pass over the event's tokens."""
        bs = self.block_size
        first_index, first_slot = new[0]
        lead = self._lead[first_slot]
        run = np.array(lead + list(token_ids[first_index * bs : (new[-1][0] + 1) * bs]), dtype=np.uint64)
        runs = _hash_runs(run, self.max_n)
        # Run position of each new block's offset 0, and the value (slot * bs + offset) of each of its positions.
        starts = np.array([len(lead) + (i - first_index) * bs for i, _ in new], dtype=np.int64)
        offsets = np.arange(bs, dtype=np.int64)
        where = (starts[:, None] + offsets).ravel()
        values = (np.array([s for _, s in new], dtype=np.int64)[:, None] * bs + offsets).ravel()
        for n in self.sizes:
            keep = np.flatnonzero(where >= n)
            keys = runs[n - 1][where[keep] - n]
            if self._keys is not None:
                wanted = self._keys[n]
                at = np.minimum(np.searchsorted(wanted, keys), max(len(wanted) - 1, 0))
                chosen = np.flatnonzero(wanted[at] == keys) if len(wanted) else at[:0]
                keep, keys = keep[chosen], keys[chosen]
            self._maps[n].update(zip(keys.tolist(), values[keep].tolist(), strict=True))

    def remove(self, block_hashes: Iterable[int], medium: str | None = None) -> int:
        """Drop blocks as a ``BlockRemoved`` event names them (those not held are ignored; a block still held in
        another medium stays).  Returns the blocks dropped.  O(block_size x sizes) a block."""
        dropped = 0
        for h in block_hashes:
            slot = self._slot.get(h)
            if slot is None:
                continue
            media = self._media[slot]
            media.discard(medium)
            if media:
                continue
            self._drop(slot)
            dropped += 1
        return dropped

    def _drop(self, slot: int) -> None:
        bs = self.block_size
        ext = self._lead[slot] + self._log[slot * bs : (slot + 1) * bs]
        lead = len(self._lead[slot])
        for offset in range(bs):
            value = slot * bs + offset
            for n, h in enumerate(_ngram_hashes(ext, lead + offset, self.max_n), start=1):
                index = self._maps.get(n)
                if index is not None and index.get(h) == value:
                    del index[h]
        parent = self._parent[slot]
        if parent >= 0:
            del self._children[parent][slot]
        for child in self._children[slot]:
            self._parent[child] = -1
        del self._slot[self._hash[slot]]
        self._hash[slot], self._parent[slot], self._children[slot], self._lead[slot] = None, -1, {}, []
        self._media[slot] = set()
        self._free.append(slot)

    def lookup(self, n: int, key: int, suffix: Sequence[int], num_tokens: int) -> list[int] | None:
        """The up to ``num_tokens`` tokens that followed the latest stored occurrence of ``suffix`` (``n`` tokens,
        hash ``key``), running on into the most recently stored child block at each block's end; or None.
        O(n + num_tokens)."""
        value = self._maps[n].get(key)
        if value is None:
            return None
        bs = self.block_size
        slot, offset = divmod(value, bs)
        log = self._log
        start = slot * bs
        before = log[max(start, value - n) : value]
        if len(before) < n:
            before = self._lead[slot][len(before) - n :] + before
        if before != list(suffix):
            return None
        out = log[value : min(start + bs, value + num_tokens)]
        children = self._children
        while len(out) < num_tokens and children[slot]:
            slot = next(reversed(children[slot]))
            out += log[slot * bs : slot * bs + min(bs, num_tokens - len(out))]
        return out

    def check_invariants(self) -> None:
        """Recompute the links and the index from the blocks and compare.  O(blocks x block_size x sizes).

        Raises:
            AssertionError: naming the first difference.
        """
        bs = self.block_size
        held = {slot for slot in self._slot.values()}
        assert held.isdisjoint(self._free), "a held slot is on the free list"
        assert len(held) + len(self._free) == len(self._hash), "slots are neither held nor free"
        for h, slot in self._slot.items():
            assert self._hash[slot] == h and self._media[slot], f"slot {slot}: hash or media wrong"
            parent = self._parent[slot]
            assert parent < 0 or (parent in held and slot in self._children[parent]), f"slot {slot}: parent link"
            assert all(self._parent[c] == slot for c in self._children[slot]), f"slot {slot}: child link"
        for n, index in self._maps.items():
            for value in index.values():
                slot, offset = divmod(value, bs)
                assert slot in held, f"{n}-gram entry {value} points into a dropped block"
                assert len(self._lead[slot]) + offset >= n, f"{n}-gram entry {value} has fewer tokens before it"
