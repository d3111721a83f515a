"""Restores that fail leave the cache as it was: a snapshot written wrong refused before ``replace`` drops anything,
manifests no reader expects refused with the package's errors, and a fault injected at any step of a restore (or of
the host tier's clearing) leaks no block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_snapshot import _resign, _version, busy_cache, describe, make_pool, serve

from prefixcache import RadixCache
from prefixcache.cache.host import make_host_pool
from prefixcache.cache.snapshot import host as host_snapshot
from prefixcache.cache.snapshot import tree as snapshot
from prefixcache.errors import SnapshotCorruptError
from prefixcache.testing import InjectedFault, fail_on_call

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")


def tiered_cache(device_blocks: int = 8, host_blocks: int = 32) -> RadixCache:
    pool = make_pool(device_blocks)
    return RadixCache(pool, host_pool=make_host_pool(pool, host_blocks))


def filled_tiered_cache() -> RadixCache:
    """A small device pool over a host tier: most of what was served has been demoted into host runs."""
    cache = tiered_cache()
    for i in range(8):
        serve(cache, [i + 1] * (5 + 2 * i), "tenant" if i % 3 == 0 else None, seed=i)
    assert cache.stats().host_used_blocks > 4
    return cache


BAD_NODE = {
    "hit_count_a_string": lambda m: m["nodes"][0].update(hit_count="many"),
    "parent_after_child": lambda m: m["nodes"][0].update(parent=len(m["nodes"]) - 1),
    "start_off": lambda m: m["nodes"][-1].update(start=m["nodes"][-1]["start"] + 1),
}


@pytest.mark.parametrize("edit", BAD_NODE.values(), ids=BAD_NODE.keys())
def test_replace_keeps_the_cache_when_a_node_is_written_wrong(tmp_path: Path, edit) -> None:
    busy_cache().save(tmp_path / "snap")
    _resign(tmp_path / "snap", edit)
    cache = busy_cache()
    before = describe(cache)

    with pytest.raises(SnapshotCorruptError, match="malformed node"):
        cache.restore(tmp_path / "snap", replace=True)

    assert describe(cache) == before
    cache.check_invariants()


def test_replace_keeps_both_tiers_when_a_host_run_is_written_wrong(tmp_path: Path) -> None:
    filled_tiered_cache().save(tmp_path / "snap")
    _resign(tmp_path / "snap", lambda m: m["host_runs"][0]["blocks"].__setitem__(0, 999))
    cache = filled_tiered_cache()
    device, host = describe(cache), [(run.key, run.tokens.tolist()) for run in cache._host.runs.values()]

    with pytest.raises(SnapshotCorruptError, match="host run"):
        cache.restore(tmp_path / "snap", replace=True)

    assert describe(cache) == device
    assert [(run.key, run.tokens.tolist()) for run in cache._host.runs.values()] == host
    cache.check_invariants()


def test_a_file_entry_that_is_not_a_record_is_corrupt(tmp_path: Path) -> None:
    busy_cache().save(tmp_path / "snap")
    _resign(tmp_path / "snap", lambda m: m["files"].update({snapshot.KV_FILE: 5}))

    with pytest.raises(SnapshotCorruptError, match="files"):
        RadixCache.load(tmp_path / "snap", make_pool())


def test_a_manifest_nested_too_deep_to_parse_is_corrupt(tmp_path: Path) -> None:
    busy_cache().save(tmp_path / "snap")
    (_version(tmp_path / "snap") / snapshot.MANIFEST).write_text("[" * 100_000)

    with pytest.raises(SnapshotCorruptError, match="not a snapshot manifest"):
        RadixCache.load(tmp_path / "snap", make_pool())


RESTORE_STEPS = [
    (snapshot, "_link"),
    (snapshot, "check_nodes"),
    (snapshot, "choose"),
    (host_snapshot, "apply"),
    (host_snapshot, "plan"),
]


@pytest.mark.parametrize(("module", "name"), RESTORE_STEPS, ids=[name for _, name in RESTORE_STEPS])
@pytest.mark.parametrize("replace", [False, True])
def test_a_fault_at_any_step_of_a_restore_leaks_no_block(tmp_path: Path, module, name: str, replace: bool) -> None:
    filled_tiered_cache().save(tmp_path / "snap")
    cache = filled_tiered_cache() if replace else tiered_cache()
    before = (describe(cache), cache.stats().used_blocks, cache.stats().host_used_blocks)

    with fail_on_call(module, name, 1), pytest.raises(InjectedFault):
        cache.restore(tmp_path / "snap", replace=replace)

    cache.check_invariants()
    if not replace:
        assert (describe(cache), cache.stats().used_blocks, cache.stats().host_used_blocks) == before
    cache.restore(tmp_path / "snap", replace=True)  # and a second try loads it
    cache.check_invariants()
    assert cache.stats().num_nodes > 0


@pytest.mark.parametrize("name", ["decref", "_free"])
def test_a_fault_while_clearing_the_host_tier_leaks_no_host_block(tmp_path: Path, name: str) -> None:
    num_runs = len(filled_tiered_cache()._host.runs)
    for k in range(1, num_runs + 1):
        cache = filled_tiered_cache()
        target = cache._host.pool if name == "decref" else cache._host
        with fail_on_call(target, name, k), pytest.raises(InjectedFault):
            cache._host.clear()
        cache.check_invariants()
        cache._host.clear()
        assert cache.stats().host_used_blocks == 0
        cache.check_invariants()


def test_a_restored_snapshot_saves_again_to_the_same_manifest(tmp_path: Path) -> None:
    original = filled_tiered_cache()
    original.save(tmp_path / "a")
    restored = tiered_cache()
    restored.restore(tmp_path / "a")
    restored.save(tmp_path / "b")

    def content(folder: Path) -> dict:
        manifest = json.loads((_version(folder) / snapshot.MANIFEST).read_text())["manifest"]
        names = [str(namespace) for namespace in manifest["namespaces"]]
        nodes = [
            (names[n["namespace"]], n["start"], n["tokens"], n["last_access"], n["hit_count"])
            for n in manifest["nodes"]
        ]
        return {key: manifest[key] for key in ("num_blocks", "num_tokens", "host_runs")} | {"nodes": sorted(nodes)}

    assert content(tmp_path / "a") == content(tmp_path / "b")


def test_a_fault_while_dropping_a_host_run_for_room_leaks_no_host_block() -> None:
    cache = tiered_cache(device_blocks=4, host_blocks=2)
    serve(cache, [1] * 16, seed=1)
    serve(cache, [2] * 16, seed=2)  # demotes the first document: the host tier is full
    assert cache.stats().host_used_blocks == 2

    with fail_on_call(cache._host.pool, "decref", 1) as calls:
        serve(cache, [3] * 16, seed=3)  # demotion must drop a host run for room; it fails, and is only logged

    assert calls[0] >= 1
    cache.check_invariants()
