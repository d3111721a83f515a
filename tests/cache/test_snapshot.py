"""Specification of cache snapshots: a round trip is bit-exact, saving changes nothing, a failed save leaves the
previous snapshot current, damaged or foreign snapshots are refused, and a small pool loads the most recent part."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from prefixcache import KVBlockPool, RadixCache
from prefixcache.cache.events import BlockStored
from prefixcache.cache.snapshot import folder as snapshot_folder
from prefixcache.cache.snapshot import tree as snapshot
from prefixcache.errors import SnapshotCorruptError, SnapshotError, SnapshotMismatchError, SnapshotNotFoundError

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")

BS = 4


def make_pool(num_blocks: int = 64, block_size: int = BS, **shape) -> KVBlockPool:
    shape = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "dtype": torch.float32, **shape}
    return KVBlockPool(num_blocks, block_size, device="cpu", **shape)


def serve(cache: RadixCache, tokens: list[int], namespace: str | None = None, seed: int = 0) -> None:
    """One request: acquire, reserve, fill its new rows with random K/V, commit."""
    lease = cache.acquire(tokens, namespace)
    table = cache.reserve(lease, len(tokens))
    kv, bs = cache.pool.kv, cache.block_size
    positions = torch.arange(lease.num_cached_tokens, len(tokens))
    blocks = torch.as_tensor(np.asarray(table, dtype=np.int64))[positions // bs]
    shape = (kv.shape[0], 2, len(positions), kv.shape[4], kv.shape[5])
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(kv.dtype)
    kv[:, :, blocks, positions % bs] = values
    cache.commit(lease, tokens)


SYSTEM = list(range(100, 119))  # 19 tokens: ends inside a block


def busy_cache(num_blocks: int = 64) -> RadixCache:
    """A cache with shared prefixes, branches inside blocks, two namespaces, refreshed and retained paths."""
    cache = RadixCache(make_pool(num_blocks))
    serve(cache, SYSTEM + [1, 2, 3, 4, 5, 6], seed=1)
    serve(cache, SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], seed=2)  # extends the first
    serve(cache, SYSTEM + [1, 2, 9, 9], seed=3)  # branches inside a block
    serve(cache, SYSTEM + [7] * 13, seed=4)
    serve(cache, [5, 6, 7, 8, 9], "tenant", seed=5)
    serve(cache, [5, 6, 7, 8, 1, 2, 3, 4, 5, 6], "tenant", seed=6)
    serve(cache, list(range(40, 75)), seed=7)
    cache.match(SYSTEM + [1, 2, 9])  # refresh a path
    cache.retain(SYSTEM, priority=2)
    return cache


def saved_and_changed(folder: Path) -> tuple[RadixCache, RadixCache]:
    """``busy_cache()`` saved into ``folder``, and another one with one more prompt (a save that would change it)."""
    old = busy_cache()
    old.save(folder)
    new = busy_cache()
    serve(new, [9] * 30, seed=99)
    return old, new


def describe(cache: RadixCache) -> list[tuple]:
    """Every node as (namespace, path, start, shares_first, last_access, hit_count, priority, origin, leaf)."""
    tree = cache._tree
    out = []
    for namespace, root in tree.roots.items():
        stack = [(child, ()) for child in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            path = prefix + tuple(node.tokens)
            out.append(
                (
                    str(namespace),
                    path,
                    node.start,
                    node.shares_first,
                    node.last_access,
                    node.hit_count,
                    node.priority,
                    node.origin,
                    not node.children,
                )
            )
            stack.extend((child, path) for child in node.children.values())
    return sorted(out)


def node_kv(cache: RadixCache) -> dict[tuple, torch.Tensor]:
    """The K/V of every node's blocks, keyed by (namespace, path)."""
    out = {}
    for namespace, root in cache._tree.roots.items():
        stack = [(child, ()) for child in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            path = prefix + tuple(node.tokens)
            out[str(namespace), path] = cache.pool.kv[:, :, torch.as_tensor(node.blocks, dtype=torch.long)].clone()
            stack.extend((child, path) for child in node.children.values())
    return out


def eviction_order(cache: RadixCache) -> list[list[tuple]]:
    """Evict one block at a time; the cached sequences after each step (destroys the cache's content)."""
    steps = []
    while cache.stats().evictable_blocks:
        cache.evict(1)
        steps.append(sorted(tuple(s) for ns in (None, "tenant") for s in cache.cached_sequences(ns)))
    return steps


def test_a_round_trip_is_bit_exact(tmp_path: Path) -> None:
    cache = busy_cache()
    cache.save(tmp_path / "snap")

    loaded = RadixCache.load(tmp_path / "snap", make_pool())

    loaded.check_invariants()
    assert describe(loaded) == describe(cache)
    original_kv, loaded_kv = node_kv(cache), node_kv(loaded)
    assert original_kv.keys() == loaded_kv.keys()
    for key, value in original_kv.items():
        assert torch.equal(loaded_kv[key], value), key
    assert loaded.stats().retained_tokens == cache.stats().retained_tokens > 0
    assert loaded.stats().cached_tokens == cache.stats().cached_tokens


def test_k_v_copied_in_chunks_round_trips_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot, "COPY_CHUNK_BLOCKS", 3)
    cache = busy_cache()
    cache.save(tmp_path / "snap")

    loaded = RadixCache.load(tmp_path / "snap", make_pool())

    original_kv = node_kv(cache)
    assert all(torch.equal(value, original_kv[key]) for key, value in node_kv(loaded).items())
    assert node_kv(loaded).keys() == original_kv.keys()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_precision_k_v_round_trips_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    cache = RadixCache(make_pool(dtype=dtype))
    serve(cache, SYSTEM + [1, 2, 3], seed=1)
    serve(cache, SYSTEM + [4, 5], seed=2)
    cache.save(tmp_path / "snap")

    loaded = RadixCache.load(tmp_path / "snap", make_pool(dtype=dtype))

    original_kv = node_kv(cache)
    assert node_kv(loaded).keys() == original_kv.keys()
    for key, value in node_kv(loaded).items():
        assert value.dtype == dtype and torch.equal(value.view(torch.int16), original_kv[key].view(torch.int16))


def test_restored_cache_matches_every_prompt_like_the_original(tmp_path: Path) -> None:
    cache = busy_cache()
    cache.save(tmp_path / "snap")
    loaded = RadixCache.load(tmp_path / "snap", make_pool())
    rng = np.random.default_rng(0)
    prompts = [seq for ns in (None, "tenant") for seq in cache.cached_sequences(ns)]
    prompts += [SYSTEM[: rng.integers(1, 20)] + rng.integers(0, 12, rng.integers(0, 15)).tolist() for _ in range(200)]

    for i, prompt in enumerate(prompts):
        namespace = "tenant" if i % 3 == 0 else None
        a, b = cache.match(prompt, namespace), loaded.match(prompt, namespace)
        assert a.num_tokens == b.num_tokens
        assert torch.equal(
            cache.pool.kv[:, :, torch.as_tensor(a.block_table, dtype=torch.long)],
            loaded.pool.kv[:, :, torch.as_tensor(b.block_table, dtype=torch.long)],
        )
    # The same matches kept both LRU orders equal: eviction takes the same blocks in the same order.
    assert describe(loaded) == describe(cache)
    assert eviction_order(loaded) == eviction_order(cache)


def test_saving_changes_nothing_in_the_cache(tmp_path: Path) -> None:
    cache = busy_cache()
    before = (describe(cache), cache.stats(), cache.pool.ref_counts(), cache.pool.free_block_ids())
    order = [node.node_id for node in cache._tree.evictor.members()]

    cache.save(tmp_path / "snap")

    assert (describe(cache), cache.stats()) == before[:2]
    assert np.array_equal(cache.pool.ref_counts(), before[2])
    assert np.array_equal(cache.pool.free_block_ids(), before[3])
    assert [node.node_id for node in cache._tree.evictor.members()] == order
    cache.check_invariants()


def test_running_requests_private_blocks_are_not_saved_and_restored_nodes_are_unlocked(tmp_path: Path) -> None:
    cache = busy_cache()
    lease = cache.acquire(SYSTEM + [1, 2, 3, 4, 5, 6, 7, 50, 51])
    cache.reserve(lease, len(SYSTEM) + 12)
    handle = cache.lock(cache.match(list(range(40, 60))))

    cache.save(tmp_path / "snap")
    loaded = RadixCache.load(tmp_path / "snap", make_pool())

    assert describe(loaded) == describe(cache)  # the committed tree, locked nodes included
    assert loaded.match(SYSTEM + [1, 2, 3, 4, 5, 6, 7, 50]).num_tokens == len(SYSTEM) + 7
    assert loaded.stats().locked_tokens == 0 and cache.stats().locked_tokens > 0
    assert loaded.stats().used_blocks == cache.stats().used_blocks - len(lease.block_table) + lease.first_owned_block
    cache.release(lease)
    cache.unlock(handle)
    cache.check_invariants()
    loaded.check_invariants()


def test_namespaces_survive_and_stay_apart(tmp_path: Path) -> None:
    cache = busy_cache()
    cache.save(tmp_path / "snap")
    loaded = RadixCache.load(tmp_path / "snap", make_pool())

    assert sorted(map(tuple, loaded.cached_sequences("tenant"))) == sorted(map(tuple, cache.cached_sequences("tenant")))
    assert loaded.match([5, 6, 7, 8, 9]).num_tokens == 0
    assert loaded.match([5, 6, 7, 8, 9], "tenant").num_tokens == 5


def test_keep_namespace_saves_only_the_chosen_namespaces(tmp_path: Path) -> None:
    cache = busy_cache()
    cache.save(tmp_path / "snap", keep_namespace=lambda ns: ns == "tenant")
    loaded = RadixCache.load(tmp_path / "snap", make_pool())

    assert loaded.cached_sequences(None) == []
    assert loaded.stats().cached_tokens == len(set(describe_paths(cache, "tenant")))


def describe_paths(cache: RadixCache, namespace: str) -> list[tuple]:
    return [p[:i] for p in map(tuple, cache.cached_sequences(namespace)) for i in range(1, len(p) + 1)]


def test_a_metadata_only_pool_round_trips_without_kv(tmp_path: Path) -> None:
    cache = RadixCache(KVBlockPool(32, BS))
    for seq in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [7, 7, 7, 7, 7, 7, 7, 7, 7]):
        cache.insert(seq, cache.allocate(-(-len(seq) // BS)))
    cache.save(tmp_path / "snap")

    loaded = RadixCache.load(tmp_path / "snap", KVBlockPool(32, BS))

    assert describe(loaded) == describe(cache)
    assert not (Path(snapshot.read(tmp_path / "snap").path) / snapshot.KV_FILE).exists()
    loaded.check_invariants()


def test_a_listener_hears_every_restored_block(tmp_path: Path) -> None:
    cache = busy_cache()
    cache.save(tmp_path / "snap")
    heard: list = []
    loaded = RadixCache(make_pool())
    loaded.subscribe(heard.append)

    loaded.restore(tmp_path / "snap")

    stored = sum(len(e.block_hashes) for e in heard if isinstance(e, BlockStored))
    full_blocks = sum(len(node_hashes) for node_hashes in _block_hashes(loaded))
    assert stored == full_blocks > 0
    loaded.check_invariants()


def _block_hashes(cache: RadixCache) -> list[list[int]]:
    out = []
    for root in cache._tree.roots.values():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            out.append(node.block_hashes or [])
            stack.extend(node.children.values())
    return out


def test_a_smaller_pool_loads_the_most_recently_used_prefixes(tmp_path: Path) -> None:
    cache = RadixCache(make_pool(64))
    conversations = [[c] * 8 for c in range(1, 9)]  # 8 unrelated sequences of 2 blocks each
    for i, seq in enumerate(conversations):
        serve(cache, seq, seed=i)
    for c in (3, 7, 1):  # most recent last
        cache.match(conversations[c - 1])
    cache.save(tmp_path / "snap")

    loaded = RadixCache.load(tmp_path / "snap", make_pool(7))  # room for 3 of them, one block to spare

    assert sorted(map(tuple, loaded.cached_sequences(None))) == sorted(tuple([c] * 8) for c in (3, 7, 1))
    loaded.check_invariants()


def test_a_smaller_pool_loads_whole_prefixes_only(tmp_path: Path) -> None:
    cache = busy_cache()
    cache.save(tmp_path / "snap")
    full = describe(cache)
    original_kv = node_kv(cache)

    for num_blocks in (1, 3, 5, 8, 13, 20):
        loaded = RadixCache(make_pool(num_blocks))
        summary = loaded.restore(tmp_path / "snap")

        loaded.check_invariants()
        nodes = describe(loaded)
        # Every loaded node is a saved one, its parent included (checked by the invariants); it may be a leaf now and,
        # past the small pool's retention cap, unretained.
        assert {n[:6] + n[7:8] for n in nodes} <= {n[:6] + n[7:8] for n in full}
        assert loaded.stats().retained_blocks <= loaded._tree.retention.cap_blocks
        assert summary.num_nodes == len(nodes) and summary.skipped_nodes == len(full) - len(nodes)
        assert summary.num_blocks == loaded.stats().used_blocks <= num_blocks
        for key, value in node_kv(loaded).items():
            assert torch.equal(value, original_kv[key])


def test_loading_needs_an_empty_cache_and_changes_nothing_when_refused(tmp_path: Path) -> None:
    busy_cache().save(tmp_path / "snap")
    cache = RadixCache(make_pool())
    serve(cache, [1, 2, 3])
    before = describe(cache)

    with pytest.raises(SnapshotError, match="empty cache"):
        cache.restore(tmp_path / "snap")

    assert describe(cache) == before
    cache.check_invariants()


def test_replace_drops_the_old_content_only_after_the_snapshot_checks_out(tmp_path: Path) -> None:
    busy_cache().save(tmp_path / "snap")
    cache = RadixCache(make_pool())
    serve(cache, [1, 2, 3])
    _flip_a_byte(tmp_path / "snap")
    with pytest.raises(SnapshotCorruptError):
        cache.restore(tmp_path / "snap", replace=True)
    assert cache.match([1, 2, 3]).num_tokens == 3

    busy_cache().save(tmp_path / "snap")
    cache.restore(tmp_path / "snap", replace=True)
    assert cache.match([1, 2, 3]).num_tokens == 0
    assert describe(cache) == describe(busy_cache())


def test_a_missing_snapshot_is_reported_as_not_found(tmp_path: Path) -> None:
    with pytest.raises(SnapshotNotFoundError):
        RadixCache.load(tmp_path / "nothing-here", make_pool())
    (tmp_path / "empty").mkdir()
    with pytest.raises(SnapshotNotFoundError):
        RadixCache.load(tmp_path / "empty", make_pool())


# ---- damaged and foreign snapshots --------------------------------------------------------------------------


def _version(folder: Path) -> Path:
    return folder / (folder / snapshot.CURRENT).read_text().strip()


def _flip_a_byte(folder: Path) -> None:
    path = _version(folder) / snapshot.KV_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(folder: Path) -> None:
    path = _version(folder) / snapshot.KV_FILE
    path.write_bytes(path.read_bytes()[:-100])


def _edit_a_token(folder: Path) -> None:
    path = _version(folder) / snapshot.MANIFEST
    document = json.loads(path.read_text())
    document["manifest"]["nodes"][0]["tokens"][0] += 1
    path.write_text(json.dumps(document))


def _edit_the_clock(folder: Path) -> None:
    path = _version(folder) / snapshot.MANIFEST
    path.write_text(path.read_text().replace('"clock":', '"clock":1', 1))


def _cut_the_json(folder: Path) -> None:
    path = _version(folder) / snapshot.MANIFEST
    path.write_text(path.read_text()[:-10])


def _drop_the_kv_file(folder: Path) -> None:
    (_version(folder) / snapshot.KV_FILE).unlink()


def _point_nowhere(folder: Path) -> None:
    (folder / snapshot.CURRENT).write_text("snapshot-000-gone\n")


def _point_outside(folder: Path) -> None:
    (folder / snapshot.CURRENT).write_text("../../etc\n")


DAMAGE = [_flip_a_byte, _truncate, _edit_a_token, _edit_the_clock, _cut_the_json, _drop_the_kv_file, _point_nowhere]
DAMAGE.append(_point_outside)


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__.strip("_") for d in DAMAGE])
def test_damaged_snapshots_are_refused_and_the_cache_stays_empty(tmp_path: Path, damage) -> None:
    busy_cache().save(tmp_path / "snap")
    damage(tmp_path / "snap")
    cache = RadixCache(make_pool())

    with pytest.raises(SnapshotCorruptError):
        cache.restore(tmp_path / "snap")

    assert cache.stats().cached_tokens == 0 and cache.stats().used_blocks == 0
    cache.check_invariants()


@pytest.mark.parametrize(
    "shape",
    [{"block_size": 8}, {"dtype": torch.float16}, {"dtype": torch.bfloat16}, {"num_kv_heads": 1}, {"num_layers": 3}],
    ids=["block_size", "float16", "bfloat16", "kv_heads", "layers"],
)
def test_a_snapshot_of_another_pool_shape_is_refused(tmp_path: Path, shape: dict) -> None:
    busy_cache().save(tmp_path / "snap")
    block_size = shape.pop("block_size", BS)
    key = "block_size" if block_size != BS else next(iter(shape))

    with pytest.raises(SnapshotMismatchError, match=key):
        RadixCache.load(tmp_path / "snap", make_pool(64, block_size, **shape))


def test_a_snapshot_of_another_identity_is_refused(tmp_path: Path) -> None:
    busy_cache().save(tmp_path / "snap", identity={"model_fingerprint": "aaaa"})

    with pytest.raises(SnapshotMismatchError, match="model_fingerprint 'aaaa'"):
        RadixCache.load(tmp_path / "snap", make_pool(), identity={"model_fingerprint": "bbbb"})
    with pytest.raises(SnapshotMismatchError, match="without a tokenizer"):
        RadixCache.load(tmp_path / "snap", make_pool(), identity={"tokenizer": "byte"})
    assert RadixCache.load(tmp_path / "snap", make_pool(), identity={"model_fingerprint": "aaaa"}).stats().num_nodes


def test_a_snapshot_of_another_format_version_is_refused(tmp_path: Path) -> None:
    busy_cache().save(tmp_path / "snap")
    path = _version(tmp_path / "snap") / snapshot.MANIFEST
    document = json.loads(path.read_text())
    document["manifest"]["version"] = 99
    document["checksum"]["xxh3_128"] = snapshot_folder.digest(snapshot_folder.canonical(document["manifest"]))
    path.write_text(json.dumps(document))

    with pytest.raises(SnapshotMismatchError, match="version 99"):
        RadixCache.load(tmp_path / "snap", make_pool())


def _resign(folder: Path, edit) -> None:
    """Edit the manifest and write its checksum again: a snapshot written wrong, not one damaged on disk."""
    path = _version(folder) / snapshot.MANIFEST
    document = json.loads(path.read_text())
    edit(document["manifest"])
    document["checksum"]["xxh3_128"] = snapshot_folder.digest(snapshot_folder.canonical(document["manifest"]))
    path.write_text(json.dumps(document))


def _hold_twice(manifest: dict) -> None:
    """Give a node's own last block to another node as well."""
    other = next(n for n in manifest["nodes"][1:] if len(n["blocks"]) > 1 or not n["shares_first"])
    other["blocks"][-1] = manifest["nodes"][0]["blocks"][-1]


WRITTEN_WRONG = {
    "no_pool": lambda m: m.pop("pool"),
    "identity_null": lambda m: m.update(identity=None),
    "files_null": lambda m: m.update(files=None),
    "clock_a_string": lambda m: m.update(clock="x"),
    "no_namespaces": lambda m: m.update(namespaces=[]),
    "block_out_of_range": lambda m: m["nodes"][0].update(blocks=[999] * len(m["nodes"][0]["blocks"])),
    "negative_token": lambda m: m["nodes"][0]["tokens"].__setitem__(0, -1),
    "string_token": lambda m: m["nodes"][0]["tokens"].__setitem__(0, "a"),
    "duplicate_sibling": lambda m: m["nodes"].append(dict(m["nodes"][0])),
    "block_held_twice": lambda m: _hold_twice(m),
    "hit_count_a_string": lambda m: m["nodes"][0].update(hit_count="many"),
}


@pytest.mark.parametrize("edit", WRITTEN_WRONG.values(), ids=WRITTEN_WRONG.keys())
def test_a_manifest_written_wrong_is_refused_before_any_block_is_taken(tmp_path: Path, edit) -> None:
    busy_cache().save(tmp_path / "snap")
    _resign(tmp_path / "snap", edit)
    cache = RadixCache(make_pool())

    with pytest.raises(SnapshotCorruptError):
        cache.restore(tmp_path / "snap")
    assert (cache.stats().num_nodes, cache.pool.num_used_blocks) == (0, 0)
    cache.check_invariants()


@pytest.mark.parametrize("where", ["folder", "parent"])
def test_saving_into_a_file_is_refused_naming_it(tmp_path: Path, where: str) -> None:
    (tmp_path / "file").write_text("not a folder")
    target = tmp_path / "file" if where == "folder" else tmp_path / "file" / "snap"

    with pytest.raises(SnapshotError, match="is a file, not a folder"):
        busy_cache().save(target)
    assert (tmp_path / "file").read_text() == "not a folder"
