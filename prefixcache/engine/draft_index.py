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

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["BlockTree", "ContextIndex", "suffix_hashes"]

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


class ContextIndex:
    """One request's tokens and, per n-gram size, where each n-gram last stood with a token after it.

    ``tokens`` is a list of ints; position ``p`` (``n <= p < len(tokens)``) is indexed under the n-gram
    ``tokens[p - n : p]``, later positions replacing earlier ones.  ``tail`` holds the hashes of the last
    ``1 .. max_n`` tokens (what a lookup asks for).  Memory: one dict entry per distinct n-gram and size (about 100
    bytes each).
    """

    __slots__ = ("_by_n", "_maps", "max_n", "sizes", "tail", "tokens")

    def __init__(self, ngram_sizes: Sequence[int], token_ids: Iterable[int] = ()) -> None:
        self.sizes = tuple(ngram_sizes)
        self.max_n = max(self.sizes)
        self.tokens: list[int] = []
        self.tail: list[int] = []
        self._maps: dict[int, dict[int, int]] = {n: {} for n in self.sizes}
        self._by_n = [self._maps.get(n) for n in range(1, self.max_n + 1)]
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens and index the positions they complete.  O(new tokens x sizes): about 0.3 us a key in Python,
        40 ns with NumPy from :data:`VECTOR_MIN_TOKENS` new tokens on (measured unloaded)."""
        new = token_ids.tolist() if isinstance(token_ids, np.ndarray) else list(token_ids)
        if len(new) >= VECTOR_MIN_TOKENS:
            start = len(self.tokens)
            self.tokens.extend(new)
            self._extend_vector(start, len(self.tokens))
            self.tail = suffix_hashes(self.tokens, self.max_n)
            return
        for token in new:
            self.push(token)

    def push(self, token: int) -> None:
        """Append one token.  O(sizes)."""
        tokens, tail = self.tokens, self.tail
        p = len(tokens)
        for index, h in zip(self._by_n, tail, strict=False):
            if index is not None:
                index[h] = p
        tokens.append(token)
        # The hash of the last n tokens is the hash of the n - 1 before the new one, times M, plus it.
        self.tail = [token] + [(h * _MULT + token) & _MASK for h in tail[: self.max_n - 1]]

    def _extend_vector(self, start: int, end: int) -> None:
        low = max(0, start - self.max_n)
        runs = _hash_runs(np.array(self.tokens[low:end], dtype=np.uint64), self.max_n)
        for n in self.sizes:
            first = max(start, n)
            if first >= end:
                continue
            # The n-gram ending before position p starts at p - n, index p - n - low of the run.
            keys = runs[n - 1][first - n - low : end - n - low]
            self._maps[n].update(zip(keys.tolist(), range(first, end), strict=True))

    def lookup(self, n: int, num_tokens: int) -> list[int] | None:
        """The up to ``num_tokens`` tokens that followed the latest earlier occurrence of the context's last ``n``
        tokens, or None.  O(n + num_tokens)."""
        if n > len(self.tail):
            return None
        p = self._maps[n].get(self.tail[n - 1])
        if p is None:
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
    with it (an n-gram seen only there is then a miss until stored again).  Memory: ``block_size`` tokens and up to
    ``block_size x sizes`` dict entries a block.
    """

    __slots__ = ("_children", "_free", "_hash", "_lead", "_log", "_maps", "_media", "_parent", "_slot", "block_size",
                 "max_n", "sizes")  # fmt: skip

    def __init__(self, block_size: int, ngram_sizes: Sequence[int]) -> None:
        self.block_size = block_size
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
            keep = where >= n
            keys = runs[n - 1][where[keep] - n]
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
