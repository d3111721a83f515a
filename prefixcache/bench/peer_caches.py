"""One driver per system for the ``peers`` benchmark: the same operations, each through that system's own API.

A driver holds one fresh cache and offers what the benchmark times: ``key``/``keys`` (turn token lists into what the
system looks up: our ``array('I')``, SGLang's ``RadixKey``, vLLM's chained block hashes), ``cycle`` (one request:
match at most ``len - 1`` prompt tokens and lock them, allocate the rest, insert prompt + answer, unlock),
``match``, ``match_prefill`` (the ``len - 1`` lookup a prefill does), ``lock_unlock``, ``evict_all`` and
``num_nodes``.  Every method returns what the benchmark cross-checks between systems (tokens hit, blocks freed).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

from prefixcache.bench.peer_imports import Peer
from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.cache.tokens import as_token_array


class OursDriver:
    """Our :class:`RadixCache` on a metadata-only pool of ``capacity_tokens`` tokens."""

    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        self.label = f"ours bs={block_size}"
        self.block_size = block_size
        self.cache = RadixCache(KVBlockPool(-(-capacity_tokens // block_size), block_size))

    def key(self, tokens: list[int]) -> array:
        return as_token_array(tokens)

    def keys(self, prompt: list[int], full: list[int]) -> tuple[array, array]:
        key = as_token_array(full)
        return key[: len(prompt)], key

    def cycle(self, prompt: array, full: array) -> int:
        cache = self.cache
        lease = cache.acquire(prompt)
        cache.reserve(lease, len(full))
        cache.commit(lease, full)
        return lease.num_cached_tokens

    def match(self, key: array) -> int:
        return self.cache.match(key).num_tokens

    def match_prefill(self, key: array) -> Any:
        return self.cache.match(key, for_prefill=True)

    def matched_tokens(self, handle: Any) -> int:
        return handle.num_tokens

    def lock_unlock(self, handle: Any) -> None:
        self.cache.unlock(self.cache.lock(handle))

    def evict_all(self) -> int:
        return self.cache.evict_all().num_blocks * self.block_size

    def num_nodes(self) -> int:
        return self.cache.stats().num_nodes


class _SlotFreeList:
    """KV slot indices as an int64 tensor: allocation takes the head; freed slots are collected and joined to the
    free tensor only when an allocation needs them.  Freeing so is O(1) per call; SGLang's own allocator does the
    same inside a free group and otherwise concatenates on every free, so this errs in SGLang's favour.

    Stands in for SGLang's ``TokenToKVPoolAllocator``, which is built around a device KV pool; the radix cache only
    calls ``free_segment`` and reads ``device``.
    """

    device = "cpu"

    def __init__(self, num_slots: int) -> None:
        self.free_slots = torch.arange(1, num_slots + 1, dtype=torch.int64)
        self.released: list[torch.Tensor] = []

    def alloc(self, num_tokens: int) -> torch.Tensor:
        if num_tokens > len(self.free_slots) and self.released:
            self.free_slots = torch.cat((self.free_slots, *self.released))
            self.released = []
        out = self.free_slots[:num_tokens]
        self.free_slots = self.free_slots[num_tokens:]
        return out

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        if len(indices):
            self.released.append(indices)


class SGLangDriver:
    """SGLang's ``RadixCache`` (page size 1), as its scheduler drives it: ``match_prefix`` on ``prompt[:-1]``,
    ``inc_lock_ref``, allocate the rest, ``insert`` the finished sequence with its KV slot indices, free the slots
    the tree already held, ``dec_lock_ref``."""

    def __init__(self, peer: Peer, capacity_tokens: int) -> None:
        self.label = f"SGLang {peer.version} p=1"
        radix, base = peer.modules["radix_cache"], peer.modules["base_prefix_cache"]
        self.RadixKey = radix.RadixKey
        self.MatchPrefixParams, self.InsertParams = base.MatchPrefixParams, base.InsertParams
        self.EvictParams = base.EvictParams
        self.allocator = _SlotFreeList(capacity_tokens)
        self.cache = radix.RadixCache.create_simulated(mock_allocator=self.allocator)

    def key(self, tokens: list[int]) -> Any:
        return self.RadixKey(array("q", tokens))

    def keys(self, prompt: list[int], full: list[int]) -> tuple[Any, Any]:
        key = self.RadixKey(array("q", full))
        return key[: len(prompt)], key

    def cycle(self, prompt: Any, full: Any) -> int:
        cache = self.cache
        matched = cache.match_prefix(self.MatchPrefixParams(key=prompt[: len(prompt) - 1]))
        node, num_cached = matched.last_device_node, matched.device_prefix_len
        cache.inc_lock_ref(node)
        prefix_slots = cache.path_device_indices(node)
        new_slots = self.allocator.alloc(len(full) - num_cached)
        slots = torch.cat((prefix_slots, new_slots))
        inserted = cache.insert(self.InsertParams(key=full, value=slots))
        self.allocator.free_segment(slots[num_cached : inserted.prefix_len])
        cache.dec_lock_ref(node)
        return num_cached

    def match(self, key: Any) -> int:
        return self.cache.match_prefix(self.MatchPrefixParams(key=key)).device_prefix_len

    def match_prefill(self, key: Any) -> Any:
        return self.cache.match_prefix(self.MatchPrefixParams(key=key[: len(key) - 1]))

    def matched_tokens(self, handle: Any) -> int:
        return handle.device_prefix_len

    def lock_unlock(self, handle: Any) -> None:
        self.cache.inc_lock_ref(handle.last_device_node)
        self.cache.dec_lock_ref(handle.last_device_node)

    def evict_all(self) -> int:
        return self.cache.evict(self.EvictParams(num_tokens=self.cache.evictable_size())).num_tokens_evicted

    def num_nodes(self) -> int:
        """Nodes below the root, as our ``stats().num_nodes`` counts them."""
        count, stack = -1, [self.cache.root_node]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count


class _VllmRequest:
    """The attributes of vLLM's ``Request`` that its block hasher and ``cache_full_blocks`` read (text only: no
    multimodal features, LoRA, salt or prompt embeddings)."""

    __slots__ = ("all_token_ids", "num_tokens", "block_hashes", "mm_features", "lora_request", "cache_salt")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.all_token_ids = tokens
        self.num_tokens = len(tokens)
        self.block_hashes: list[Any] = []
        self.mm_features: list[Any] = []
        self.lora_request = None
        self.cache_salt = None

    def __getattr__(self, name: str) -> Any:
        return None


class VllmDriver:
    """vLLM's v1 ``BlockPool`` with its request block hasher (default ``sha256`` over pickled block contents), as
    its KV cache manager drives them: hash the request's full blocks, look up the longest run of cached blocks of
    ``prompt[:-1]``, ``touch`` them, ``get_new_blocks`` for the rest, ``cache_full_blocks``, ``free_blocks``."""

    def __init__(self, peer: Peer, block_size: int, capacity_tokens: int) -> None:
        self.label = f"vLLM {peer.version} bs={block_size}"
        self.block_size = block_size
        utils, pool, hashing = peer.modules["kv_cache_utils"], peer.modules["block_pool"], peer.modules["hashing"]
        utils.init_none_hash(hashing.sha256)
        self.hasher: Callable[[Any], list[Any]] = utils.get_request_block_hasher(block_size, hashing.sha256)
        # One more block than the capacity: the pool keeps block 0 as its null block.
        self.pool = pool.BlockPool(-(-capacity_tokens // block_size) + 1, True, block_size)

    def key(self, tokens: list[int]) -> _VllmRequest:
        request = _VllmRequest(tokens)
        request.block_hashes = self.hasher(request)
        return request

    def keys(self, prompt: list[int], full: list[int]) -> tuple[int, _VllmRequest]:
        # A vLLM request hashes its tokens once; the prompt is the first len(prompt) of them.
        return len(prompt), self.key(full)

    def _lookup(self, request: _VllmRequest, max_tokens: int) -> list[Any]:
        hits = []
        get = self.pool.get_cached_block
        for block_hash in request.block_hashes[: max_tokens // self.block_size]:
            found = get(block_hash, [0])
            if found is None:
                break
            hits.append(found[0])
        return hits

    def cycle(self, prompt: int | _VllmRequest, full: _VllmRequest) -> int:
        pool, bs = self.pool, self.block_size
        hits = self._lookup(full, (prompt if isinstance(prompt, int) else prompt.num_tokens) - 1)
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(-(-full.num_tokens // bs) - len(hits))
        pool.cache_full_blocks(full, blocks, len(hits), full.num_tokens // bs, bs, 0)
        pool.free_blocks(reversed(blocks))
        return len(hits) * bs

    def match(self, key: _VllmRequest) -> int:
        return len(self._lookup(key, key.num_tokens)) * self.block_size

    def match_prefill(self, key: _VllmRequest) -> list[Any]:
        return self._lookup(key, key.num_tokens - 1)

    def matched_tokens(self, handle: list[Any]) -> int:
        return len(handle) * self.block_size

    def lock_unlock(self, handle: list[Any]) -> None:
        self.pool.touch(handle)
        self.pool.free_blocks(reversed(handle))

    def evict_all(self) -> int:
        cached = len(self.pool.cached_block_hash_to_block)
        assert self.pool.reset_prefix_cache(), "every block is free, so the prefix cache can be reset"
        return cached * self.block_size

    def num_nodes(self) -> int:
        return len(self.pool.cached_block_hash_to_block)
