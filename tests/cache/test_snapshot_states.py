"""Specification of snapshots of a cache that keeps recurrent states (prefixcache.cache.snapshot.states): the states
kept on the saved nodes come back with them, value included, checked as the K/V are; a restored cache resumes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixcache import KVBlockPool, RadixCache, StateMarker
from prefixcache.errors import SnapshotCorruptError

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")

BS = 4
SEQ = list(range(100, 120))


def make_cache(max_state_bytes: int | None = 100, num_blocks: int = 64) -> RadixCache:
    pool = KVBlockPool(num_blocks, BS, num_layers=1, num_kv_heads=1, head_dim=2)
    if max_state_bytes is None:
        return RadixCache(pool)
    return RadixCache(pool, resume_states=True, max_state_bytes=max_state_bytes)


def run(cache: RadixCache, prompt: list[int], answer: list[int], nbytes: int = 1) -> None:
    lease = cache.acquire(prompt, num_tokens=len(prompt))
    for point in lease.state_points:  # as the engine does: a state where its prefill passes a branch mark
        assert cache.put_state(lease, point, StateMarker(nbytes))
    cache.insert_prefix(lease, prompt, state=StateMarker(nbytes))
    cache.reserve(lease, len(prompt) + len(answer))
    cache.commit(lease, prompt + answer, state=StateMarker(nbytes))


def saved(tmp_path: Path) -> Path:
    cache = make_cache()
    run(cache, SEQ[:10], SEQ[10:14])
    run(cache, SEQ[:6] + [7, 7, 7], [8, 8])  # parts at 6: a state there from now on (a branch mark)
    summary = cache.save(tmp_path / "snap")
    assert (summary.num_states, summary.state_bytes) == (5, 5)  # 6, 9, 10, 11 and 14
    return tmp_path / "snap"


def test_a_restored_cache_resumes_the_saved_states(tmp_path: Path) -> None:
    loaded = RadixCache.load(saved(tmp_path), make_cache().pool, resume_states=True, max_state_bytes=100)
    assert loaded.state_positions(SEQ[:14]) == [6, 10, 14]
    lease = loaded.acquire(SEQ[:18])
    assert (lease.num_matched_tokens, lease.num_cached_tokens) == (14, 14)
    loaded.release(lease)
    assert loaded.stats().num_states == 5
    loaded.check_invariants()


def test_a_smaller_state_budget_keeps_the_most_valuable_states(tmp_path: Path) -> None:
    pool = make_cache().pool
    loaded = RadixCache.load(saved(tmp_path), pool, resume_states=True, max_state_bytes=2)
    # By tokens resumed per byte: the deepest two, 14 and 11.
    assert loaded.state_positions(SEQ[:14]) == [14] and loaded.state_positions(SEQ[:6] + [7, 7, 7, 8, 8]) == [11]
    loaded.check_invariants()


def test_a_cache_that_keeps_no_states_restores_the_kv_alone(tmp_path: Path) -> None:
    plain = RadixCache.load(saved(tmp_path), make_cache(None).pool)
    assert (plain.stats().cached_tokens, plain.stats().num_states) == (19, 0)  # 14 tokens and a branch of 5
    plain.check_invariants()


def test_a_state_record_outside_its_node_is_refused_before_the_cache_changes(tmp_path: Path) -> None:
    folder = saved(tmp_path)
    version = folder / (folder / "CURRENT").read_text().strip()
    document = json.loads((version / "snapshot.json").read_text())
    node = next(n for n in document["manifest"]["nodes"] if n.get("states"))
    node["states"][0]["position"] = node["start"]  # a state must stand after at least one of its node's tokens
    from prefixcache.cache.snapshot.folder import canonical, digest

    document["checksum"]["xxh3_128"] = digest(canonical(document["manifest"]))
    (version / "snapshot.json").write_text(json.dumps(document))
    cache = make_cache()
    run(cache, [1, 2, 3], [4])
    with pytest.raises(SnapshotCorruptError, match="malformed state"):
        cache.restore(folder, replace=True)
    assert cache.stats().num_states == 2 and cache.stats().cached_tokens == 4
    cache.check_invariants()


# ---- states with tensors, rebuilt by a loader ------------------------------------------------------------------


class Tensors:
    """A state with one tensor, as a model's: ``snapshot_parts`` gives it, a loader rebuilds it."""

    def __init__(self, tensor) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()

    def snapshot_parts(self):
        return {}, {"t": self.tensor}


def load_tensors(position: int, meta: dict, tensors: dict) -> Tensors:
    from prefixcache.errors import SnapshotMismatchError

    if set(tensors) != {"t"}:
        raise SnapshotMismatchError(f"a state needs its tensor t, got {sorted(tensors)}")
    return Tensors(tensors["t"])


def saved_tensors(tmp_path: Path) -> Path:
    import torch

    cache = make_cache(max_state_bytes=1000)
    lease = cache.acquire(SEQ[:10], num_tokens=10)
    cache.insert_prefix(lease, SEQ[:10], state=Tensors(torch.arange(4, dtype=torch.float32)))
    cache.release(lease)
    cache.save(tmp_path / "snap")
    return tmp_path / "snap"


def edit(folder: Path, manifest=None, tensors=None) -> None:
    """Edit the snapshot in ``folder`` and put its checksums right, as a deliberate edit would."""
    import safetensors.torch

    from prefixcache.cache.snapshot.folder import canonical, digest

    version = folder / (folder / "CURRENT").read_text().strip()
    document = json.loads((version / "snapshot.json").read_text())
    if tensors is not None:
        loaded = safetensors.torch.load((version / "kv.safetensors").read_bytes())
        tensors(loaded, document["manifest"])
        blob = safetensors.torch.save(loaded)
        (version / "kv.safetensors").write_bytes(blob)
        document["manifest"]["files"]["kv.safetensors"].update(bytes=len(blob), xxh3_128=digest(blob))
    if manifest is not None:
        manifest(document["manifest"])
    document["checksum"]["xxh3_128"] = digest(canonical(document["manifest"]))
    (version / "snapshot.json").write_text(json.dumps(document))


def the_state(manifest: dict) -> dict:
    return next(state for node in manifest["nodes"] for state in node.get("states", ()))


def refused(folder: Path, error: type, match: str) -> None:
    """Restoring ``folder`` into a cache holding one state raises ``error``, the cache as it was."""
    cache = make_cache(max_state_bytes=16)
    run(cache, [1, 2, 3], [4])
    with pytest.raises(error, match=match):
        cache.restore(folder, replace=True, state_loader=load_tensors)
    assert (cache.stats().num_states, cache.stats().state_bytes, cache.stats().cached_tokens) == (2, 2, 4)
    cache.check_invariants()


def test_a_state_with_tensors_comes_back_through_the_loader(tmp_path: Path) -> None:
    import torch

    loaded = make_cache(max_state_bytes=16)
    loaded.restore(saved_tensors(tmp_path), state_loader=load_tensors)
    assert loaded.state_positions(SEQ[:10]) == [10] and loaded.stats().state_bytes == 16
    lease = loaded.acquire(SEQ[:12])
    assert lease.num_cached_tokens == 10 and torch.equal(lease.resume_state.tensor, torch.arange(4.0))
    loaded.release(lease)
    loaded.check_invariants()


def test_a_state_recording_fewer_bytes_than_its_tensors_is_refused(tmp_path: Path) -> None:
    # Kept at its recorded size, it would hold 16 bytes under a budget that counts 1.
    folder = saved_tensors(tmp_path)
    edit(folder, manifest=lambda m: the_state(m).update(nbytes=1))
    refused(folder, SnapshotCorruptError, "records 1 bytes; its tensors make 16")


def test_a_state_record_stripped_of_its_tensors_is_refused_by_the_loader(tmp_path: Path) -> None:
    # Put back as a marker, it would fail the first request resuming it.
    from prefixcache.errors import SnapshotMismatchError

    folder = saved_tensors(tmp_path)
    edit(folder, manifest=lambda m: the_state(m).update(tensors=[]))
    refused(folder, SnapshotMismatchError, "needs its tensor t")


def test_a_state_tensor_named_outside_the_scheme_is_refused(tmp_path: Path) -> None:
    def rename(tensors: dict, manifest: dict) -> None:
        state = the_state(manifest)
        tensors["state.x"] = tensors.pop(state["tensors"][0])
        state["tensors"] = ["state.x"]

    folder = saved_tensors(tmp_path)
    edit(folder, tensors=rename)
    refused(folder, SnapshotCorruptError, "malformed state")
