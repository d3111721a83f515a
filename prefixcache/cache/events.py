"""KV events: what a :class:`~prefixcache.cache.radix_cache.RadixCache` announces when full blocks enter or leave it.

A router or a second-tier store can mirror which blocks a cache holds without reading the tree, as vLLM's and
SGLang's KV event publishers allow.  Three events exist: :class:`BlockStored`, :class:`BlockRemoved` and
:class:`AllCleared`.  Listeners are plain callables taking one event (``RadixCache(pool, event_listener=f)`` or
``cache.subscribe(f)``); they run synchronously, inside the cache's lock, so they must be quick and must not change
the cache: a call that would (acquire, commit, release, evict, lock, retain...) raises
:class:`~prefixcache.errors.LockError` there; reading it (stats, match) and subscribing are allowed.  An exception
from a listener is logged and swallowed: it never breaks the cache.

Block identity.  Only *full* blocks are announced: block ``j`` of a sequence holds positions
``[j * block_size, (j + 1) * block_size)`` and is named by a chained hash of everything up to its end::

    hash_j = xxh64(hash_{j-1}.to_bytes(8, "little") + tokens_of_block_j as little-endian uint32, seed)
    hash_{-1} = namespace_root_hash(namespace, seed)    # xxh64 of the namespace's UTF-8, or of b"\\xff" for None

so equal hashes mean equal token prefixes (up to 64-bit collisions) in the same namespace.  ``seed`` is the
cache's ``hash_seed`` (0 unless configured); a consumer computes the same hashes with :func:`block_hashes`.
``b"\\xff"`` never occurs in UTF-8, so the ``None`` namespace cannot collide with any named one.

Ownership, which keeps the events consistent with the tree: block ``j`` belongs to the tree node that holds its
last token, position ``(j + 1) * block_size - 1``.  Inserting a leaf for positions ``[p, n)`` stores the blocks
with ``p < (j + 1) * block_size <= n``; evicting a leaf ``[s, e)`` removes those with
``s < (j + 1) * block_size <= e``; splitting a node announces nothing.  Replaying every event into a set
(:class:`BlockIndex`) therefore gives exactly the full blocks of the cached sequences.
"""

from __future__ import annotations

import logging
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from prefixcache.cache.pool import check_block_size
from prefixcache.cache.tokens import as_token_array
from prefixcache.errors import InvalidArgumentError, KVEventError, NamespaceError

if TYPE_CHECKING:
    from prefixcache.cache.node import Node

logger = logging.getLogger(__name__)

__all__ = [
    "DEVICE_MEDIUM",
    "HOST_MEDIUM",
    "AllCleared",
    "BlockIndex",
    "BlockRemoved",
    "BlockStored",
    "EventListener",
    "EventPublisher",
    "KVEvent",
    "block_hashes",
    "chain_hashes",
    "check_hash_seed",
    "check_namespace",
    "namespace_root_hash",
    "walk_block_hashes",
]


DEVICE_MEDIUM = "GPU"  # the ``medium`` of events of a cache with a host tier, as vLLM names its two media
HOST_MEDIUM = "CPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks newly cached, in sequence order.

    ``block_hashes[i]`` names block ``first_block + i``; ``parent_block_hash`` is the hash of block
    ``first_block - 1`` (the namespace root hash when ``first_block == 0``); ``token_ids`` are the tokens of the
    stored blocks, ``len(block_hashes) * block_size`` of them.  ``medium`` says where they live: None for a cache
    with one pool, ``"GPU"`` (the device pool) or ``"CPU"`` (host memory) with a host tier
    (:mod:`prefixcache.cache.host.tier`), as vLLM's events name them.
    """

    namespace: str | None
    block_hashes: tuple[int, ...]
    parent_block_hash: int
    first_block: int
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Full blocks evicted from the cache (from the tier ``medium`` names, when the cache has a host tier)."""

    namespace: str | None
    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The cache became empty (after removing its blocks one event at a time): drop everything held for it."""


KVEvent = BlockStored | BlockRemoved | AllCleared
EventListener = Callable[[KVEvent], None]


def check_namespace(namespace: object) -> str | None:
    """Return ``namespace`` if it is ``None`` or a ``str``.

    Raises:
        NamespaceError: any other type.
    """
    if namespace is None or type(namespace) is str:
        return namespace  # type: ignore[return-value]
    raise NamespaceError(f"namespace must be None or a str (a cache salt), got {type(namespace).__name__}")


def check_hash_seed(seed: object) -> int:
    """Return ``seed`` if it is an int xxh64 takes as it is: ``0 <= seed < 2**64``.

    Raises:
        InvalidArgumentError: anything else.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise InvalidArgumentError(f"hash_seed must be an int in [0, 2**64), got {seed!r}")
    return seed


def walk_block_hashes(
    roots: dict[str | None, Node], block_size: int, seed: int
) -> Iterator[tuple[Node, array, int, list[int]]]:
    """Every node under ``roots``, parents first, with its path's tokens, the hash before its first owned block and
    the chained hashes of the full blocks it owns, recomputed from the tokens (the hashes kept on nodes are not read).
    O(cached tokens)."""
    for namespace, root in roots.items():
        stack = [(child, root.tokens, namespace_root_hash(namespace, seed)) for child in root.children.values()]
        while stack:
            node, prefix, parent_hash = stack.pop()
            path = prefix + node.tokens
            hashes = chain_hashes(path, block_size, parent_hash, seed, node.start // block_size, node.end // block_size)
            yield node, path, parent_hash, hashes
            last = hashes[-1] if hashes else parent_hash
            stack.extend((child, path, last) for child in node.children.values())


def namespace_root_hash(namespace: str | None, seed: int = 0) -> int:
    """The chain's starting value for ``namespace``: xxh64 of its UTF-8 bytes (``b"\\xff"`` for ``None``)."""
    data = b"\xff" if namespace is None else namespace.encode("utf-8", errors="surrogatepass")
    return xxhash.xxh64_intdigest(data, seed)


def _le_bytes(token_ids: Iterable[int]) -> memoryview:
    if isinstance(token_ids, array) and token_ids.itemsize == 4 and sys.byteorder == "little":
        return memoryview(token_ids).cast("B")
    return memoryview(np.asarray(token_ids, dtype="<u4").tobytes())


def chain_hashes(
    token_ids: Iterable[int], block_size: int, parent_hash: int, seed: int, first_block: int, stop_block: int
) -> list[int]:
    """Hashes of blocks ``first_block .. stop_block - 1`` of ``token_ids`` (absolute positions), chained from
    ``parent_hash`` (the hash of block ``first_block - 1``).  O(tokens hashed), one xxh64 call per block."""
    data = _le_bytes(token_ids)
    step = 4 * block_size
    out: list[int] = []
    h = parent_hash
    for j in range(first_block, stop_block):
        h = xxhash.xxh64_intdigest(h.to_bytes(8, "little") + data[j * step : (j + 1) * step], seed)
        out.append(h)
    return out


def block_hashes(token_ids: Iterable[int], block_size: int, namespace: str | None = None, seed: int = 0) -> list[int]:
    """Chained hashes of every full block of a sequence cached in ``namespace`` with ``hash_seed == seed``.
    An empty sequence has none.

    Raises:
        InvalidArgumentError: ``block_size`` or ``seed`` one no cache accepts (``check_block_size``).
        InvalidTokensError: token ids a cache would refuse (negative, above ``2**32 - 1``, not ints).
        NamespaceError: ``namespace`` neither ``None`` nor a ``str``.
    """
    check_block_size(block_size)
    check_hash_seed(seed)
    root = namespace_root_hash(check_namespace(namespace), seed)
    ids = as_token_array(token_ids, allow_empty=True)
    return chain_hashes(ids, block_size, root, seed, 0, len(ids) // block_size)


class BlockIndex:
    """A consumer that mirrors the cached blocks from events: ``index(event)`` applies one, ``hashes`` holds
    ``(namespace, block_hash)`` pairs held in any tier, ``media`` the tiers holding each pair of events that name
    one (a cache with a host tier: ``"GPU"``, ``"CPU"``; the same block may be in both for a while).

    With ``strict`` (the default) an event that contradicts the mirror raises
    :class:`~prefixcache.errors.KVEventError` (an ``AssertionError``) and changes nothing: a block stored twice (in
    the same tier), removed while not held, or the cache cleared while blocks are held.
    """

    def __init__(self, *, strict: bool = True) -> None:
        self.strict = strict
        self.hashes: set[tuple[str | None, int]] = set()
        self.media: dict[tuple[str | None, int], set[str]] = {}
        self.num_events = 0

    def __call__(self, event: KVEvent) -> None:
        """Apply one event: all of it, or (raising) none of it.  O(blocks in the event).

        Raises:
            KVEventError: with ``strict``, the event contradicts the mirror; nothing is applied.
            InvalidArgumentError: ``event`` is not a KV event.
        """
        if not isinstance(event, (BlockStored, BlockRemoved, AllCleared)):
            raise InvalidArgumentError(f"not a KV event: {type(event).__name__}")
        if self.strict:
            self._check(event)
        self.num_events += 1
        if isinstance(event, AllCleared):
            self.hashes.clear()
            self.media.clear()
        elif event.medium is not None:
            self._apply_tiered(event)
        elif isinstance(event, BlockStored):
            self.hashes.update((event.namespace, h) for h in event.block_hashes)
        else:
            self.hashes.difference_update((event.namespace, h) for h in event.block_hashes)

    def clear(self) -> None:
        """Forget every block, as when the cache this mirrors was replaced (its publisher restarted).  O(1)."""
        self.hashes = set()
        self.media = {}

    def _check(self, event: KVEvent) -> None:
        if isinstance(event, AllCleared):
            if self.hashes:
                raise KVEventError(f"cache cleared while {len(self.hashes)} blocks are still held")
            return
        medium = event.medium
        stored = isinstance(event, BlockStored)
        seen: set[int] = set()
        for h in event.block_hashes:
            key = (event.namespace, h)
            if medium is None:
                held = key in self.hashes
            else:
                held = medium in self.media.get(key, ())
            where = "" if medium is None else f" in {medium}"
            if stored and (held or h in seen):
                raise KVEventError(f"block {h:#x} stored twice{where}")
            if not stored and (not held or h in seen):
                raise KVEventError(f"block {h:#x} removed{where} but not held")
            seen.add(h)

    def _apply_tiered(self, event: BlockStored | BlockRemoved) -> None:
        medium = event.medium
        stored = isinstance(event, BlockStored)
        for h in event.block_hashes:
            key = (event.namespace, h)
            media = self.media.get(key)
            if stored:
                if media is None:
                    media = self.media[key] = set()
                media.add(medium)
                self.hashes.add(key)
            elif media is not None and medium in media:
                media.discard(medium)
                if not media:
                    del self.media[key]
                    self.hashes.discard(key)


def _stamped(event: KVEvent, medium: str) -> KVEvent | None:
    if isinstance(event, (BlockStored, BlockRemoved)):
        return replace(event, medium=medium) if event.medium is None else event
    # An empty device pool is not an empty cache while host memory holds blocks: the tiers' removals say it all.
    return None


class EventPublisher:
    """The cache's side of KV events: its listeners, and the block hashes kept on tree nodes while anyone listens.

    Each node owning full blocks keeps their chained hashes (``node.block_hashes``), so eviction can announce
    exactly what it removes without rehashing.  With no listener nothing is hashed: the tree's cost is one test of
    :attr:`listeners` per insert and per eviction call.  Callers hold the cache's mutex.
    """

    def __init__(self, block_size: int, hash_seed: int) -> None:
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.listeners: list[EventListener] = []
        # With a host tier: the medium stamped on the tree's own events (the tier's carry their own).
        self.medium: str | None = None
        # Nonzero while listeners are being called: the cache refuses changes from inside one (locks.ChangeGuard).
        self.emitting = 0

    def emit(self, events: list[KVEvent], listeners: list[EventListener] | None = None) -> None:
        """Send ``events`` in order to every listener (or to ``listeners``); a listener's exception is logged."""
        if self.medium is not None:
            events = [e for e in (_stamped(event, self.medium) for event in events) if e is not None]
        self.emitting += 1
        try:
            for event in events:
                for callback in listeners if listeners is not None else tuple(self.listeners):
                    try:
                        callback(event)
                    except BaseException:  # noqa: B036 - a listener must never leave the tree half-updated
                        logger.exception("KV event listener %r failed on %s", callback, type(event).__name__)
        finally:
            self.emitting -= 1

    def announce_leaf(self, leaf: Node, path: array) -> None:
        """Hash the full blocks a new leaf owns (those ending inside it) and announce them.  ``path`` is the whole
        token sequence ending in the leaf."""
        bs = self.block_size
        first = leaf.start // bs
        parent_hash = self.hash_before(leaf.parent, first)
        leaf.block_hashes = chain_hashes(path, bs, parent_hash, self.hash_seed, first, len(path) // bs)
        if leaf.block_hashes:
            self.emit([self._stored_event(leaf, path, parent_hash)])

    def hash_before(self, node: Node, block: int) -> int:
        """The hash of block ``block - 1`` on the path ending at ``node`` (the root hash for block 0).  O(depth)."""
        if block == 0:
            return namespace_root_hash(node.namespace, self.hash_seed)
        last = block * self.block_size - 1
        while node.start > last:
            node = node.parent
        return node.block_hashes[block - 1 - node.start // self.block_size]

    def _stored_event(self, node: Node, path: array, parent_hash: int) -> BlockStored:
        bs = self.block_size
        first = node.start // bs
        tokens = tuple(path[first * bs : (first + len(node.block_hashes)) * bs])
        return BlockStored(node.namespace, tuple(node.block_hashes), parent_hash, first, tokens, bs)

    def hash_tree(self, roots: dict[str | None, Node]) -> list[BlockStored]:
        """Recompute every node's block hashes; return a :class:`BlockStored` per node owning full blocks.
        O(cached tokens)."""
        events: list[BlockStored] = []
        for node, path, parent_hash, hashes in walk_block_hashes(roots, self.block_size, self.hash_seed):
            node.block_hashes = hashes
            if hashes:
                events.append(self._stored_event(node, path, parent_hash))
        return events
