"""Every manifest is checked completely before the cache changes: a snapshot edited with its checksums recomputed
either loads exactly what its manifest describes (a clean one: what was saved) or is refused with SnapshotError,
leaving both tiers of the cache as they were, quiescent, with no host block leaked."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_snapshot import _resign, _version, make_pool, serve

from prefixcache import RadixCache
from prefixcache.cache.host import make_host_pool
from prefixcache.cache.snapshot import folder as snapshot_folder
from prefixcache.cache.snapshot import manifest as snapshot_manifest
from prefixcache.cache.snapshot import tree as snapshot
from prefixcache.errors import SnapshotError
from prefixcache.testing import assert_quiescent
from prefixcache.testing import snapshot as record_state

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")

SYSTEM = list(range(100, 119))  # 19 tokens: children branch inside a block and share it


def tiered(device_blocks: int, host_blocks: int) -> RadixCache:
    pool = make_pool(device_blocks)
    return RadixCache(pool, host_pool=make_host_pool(pool, host_blocks))


def source_cache() -> RadixCache:
    """Shared prefixes, a branch inside a block, two namespaces, a retained path, and runs demoted to host."""
    cache = tiered(24, 32)
    serve(cache, [9] * 30, "tenant", seed=1)
    serve(cache, list(range(200, 240)), seed=2)  # demoted by what follows
    serve(cache, SYSTEM + [1, 2, 3, 4, 5, 6], seed=3)
    serve(cache, SYSTEM + [1, 2, 9, 9], seed=4)
    serve(cache, SYSTEM + [7] * 13, seed=5)
    serve(cache, [5, 6, 7, 8, 1, 2, 3], "tenant", seed=6)
    cache.retain(SYSTEM, priority=2)
    return cache


def target_cache() -> RadixCache:
    """A cache with other content on both tiers, big enough for the whole snapshot: what a refused load keeps."""
    cache = tiered(64, 64)
    for i in range(9):
        serve(cache, [300 + i] * 37, "other" if i % 2 else None, seed=10 + i)
    assert cache.stats().host_used_blocks > 0
    return cache


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("clean") / "snap"
    source = source_cache()
    source.save(folder)
    manifest = json.loads((_version(folder) / snapshot.MANIFEST).read_text())["manifest"]
    assert any(node["shares_first"] for node in manifest["nodes"]) and manifest["host_runs"]
    return folder


def expected_content(manifest: dict) -> tuple[dict, list]:
    """What loading ``manifest`` must give: the root-to-leaf sequences of each namespace, and the host runs."""
    nodes, paths, leaves = manifest["nodes"], [], {}
    for index, node in enumerate(nodes):
        paths.append((paths[node["parent"]] if node["parent"] >= 0 else []) + node["tokens"])
        leaves[index] = True
        if node["parent"] >= 0:
            leaves[node["parent"]] = False
    sequences: dict = {}
    for index, leaf in leaves.items():
        if leaf:
            sequences.setdefault(manifest["namespaces"][nodes[index]["namespace"]], []).append(tuple(paths[index]))
    runs = sorted((int(run["key"], 16), tuple(run["tokens"])) for run in manifest.get("host_runs", []))
    return {ns: sorted(seqs) for ns, seqs in sequences.items()}, runs


def content(cache: RadixCache, namespaces) -> tuple[dict, list]:
    sequences = {ns: sorted(map(tuple, cache.cached_sequences(ns))) for ns in namespaces}
    runs = sorted((run.key, tuple(run.tokens.tolist())) for run in cache._host.runs.values())
    return {ns: seqs for ns, seqs in sequences.items() if seqs}, runs


def load_or_refuse(folder: Path) -> tuple[RadixCache, dict | None]:
    """Restore ``folder`` over a busy cache (replace=True).  Refused: assert nothing changed, return None; loaded:
    assert the cache holds what the manifest describes, and return the manifest."""
    cache = target_cache()
    namespaces = [None, "other", "tenant"]
    before = (record_state(cache, namespaces), content(cache, namespaces))
    try:
        cache.restore(folder, replace=True)
    except SnapshotError:
        assert (record_state(cache, namespaces), content(cache, namespaces)) == before
        assert_quiescent(cache)
        cache.check_invariants()
        return cache, None
    assert_quiescent(cache)
    cache.check_invariants()
    manifest = json.loads((_version(folder) / snapshot.MANIFEST).read_text())["manifest"]
    assert content(cache, set(manifest["namespaces"]) | set(namespaces)) == expected_content(manifest)
    # A manifest without host runs is a snapshot of a cache without a host tier: none are loaded (as expected_content).
    assert cache.stats().host_used_blocks == sum(len(run["blocks"]) for run in manifest.get("host_runs", []))
    return cache, manifest


def test_a_clean_snapshot_loads_what_was_saved(saved: Path) -> None:
    cache, manifest = load_or_refuse(saved)
    source = source_cache()
    assert manifest is not None
    assert content(cache, [None, "tenant", "other"]) == content(source, [None, "tenant"])


NASTY = [-1, 0, 1, 2, 3, 5, 2**32, 2**63, 2**64, 0.0, 0.5, 1.0, True, False, None, "x", "", [], {}, [0], 1e309]


def paths_of(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths_of(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths_of(item, (*prefix, index))


def at(value, path):
    for key in path:
        value = value[key]
    return value


@st.composite
def edits(draw, manifest: dict):
    """1-3 edits of ``manifest`` (a copy): set a field to a nasty value or to another field's, delete it, or
    duplicate a list element."""
    edited = copy.deepcopy(manifest)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in paths_of(edited) if p]
        path = draw(st.sampled_from(paths))
        container, key = at(edited, path[:-1]), path[-1]
        op = draw(st.sampled_from(["set", "copy", "delete", "duplicate"]))
        if op == "set":
            container[key] = copy.deepcopy(draw(st.sampled_from(NASTY)))
        elif op == "copy":
            container[key] = copy.deepcopy(at(edited, draw(st.sampled_from(paths))))
        elif op == "delete":
            del container[key]
        elif isinstance(container, list):
            container.insert(key, copy.deepcopy(container[key]))
    return edited


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_edited_manifest_loads_what_it_says_or_is_refused_leaving_the_cache_as_it_was(saved: Path, data) -> None:
    clean = json.loads((_version(saved) / snapshot.MANIFEST).read_text())["manifest"]
    edited = data.draw(edits(clean))
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "snap"
        shutil.copytree(saved, folder)
        _resign(folder, lambda manifest: (manifest.clear(), manifest.update(edited)))
        load_or_refuse(folder)  # loaded: what the edited manifest says (a clean load where the edit changed none)


def _node(manifest: dict, predicate) -> dict:
    return next(node for node in manifest["nodes"] if predicate(node))


def _share_parents_last_block_aligned(manifest: dict) -> None:
    child = _node(manifest, lambda n: n["parent"] >= 0 and not n["shares_first"] and n["start"] % 4 == 0)
    child["blocks"][0] = manifest["nodes"][child["parent"]]["blocks"][-1]
    child["shares_first"] = True


def _two_children_share(manifest: dict) -> None:
    """A second child of a parent whose last block a child shares, sharing it too (within that block only)."""
    sharer = _node(manifest, lambda n: n["shares_first"] and len(n["blocks"]) == 1)
    twin = {**copy.deepcopy(sharer), "tokens": [t + 1000 for t in sharer["tokens"]]}
    manifest["nodes"].append(twin)
    manifest["num_tokens"] += len(twin["tokens"])


def _host(manifest: dict, value: int) -> None:
    manifest["host_runs"][0]["tokens"][0] = value


SPECIFIC = {
    "one_block_twice_in_a_node": lambda m: _node(m, lambda n: len(n["blocks"]) > 1)["blocks"].__setitem__(
        1, _node(m, lambda n: len(n["blocks"]) > 1)["blocks"][0]
    ),
    "child_shares_a_full_parent_block": _share_parents_last_block_aligned,
    "two_children_share_a_parent_block": _two_children_share,
    "duplicated_namespaces": lambda m: m["namespaces"].append(m["namespaces"][0]),
    "duplicated_namespace_used": lambda m: (
        m["namespaces"].append(m["namespaces"][0]),
        m["nodes"][0].update(namespace=len(m["namespaces"]) - 1),
    ),
    "float_namespace_index": lambda m: m["nodes"][0].update(namespace=float(m["nodes"][0]["namespace"])),
    "float_namespace": lambda m: m["namespaces"].__setitem__(0, 1.5),
    "node_without_origin": lambda m: m["nodes"][-1].pop("origin"),
    "negative_host_token": lambda m: _host(m, -1),
    "too_large_host_token": lambda m: _host(m, 2**32),
    "float_start": lambda m: m["nodes"][0].update(start=0.0),
    "bool_shares_first_as_int": lambda m: _node(m, lambda n: n["shares_first"]).update(shares_first=1),
    "huge_last_access": lambda m: m["nodes"][0].update(last_access=2**64),
    "host_key_not_hex": lambda m: m["host_runs"][0].update(key="-" + m["host_runs"][0]["key"][1:]),
    "host_first_a_float": lambda m: m["host_runs"][0].update(first=0.5),
}


@pytest.mark.parametrize("edit", SPECIFIC.values(), ids=SPECIFIC.keys())
def test_each_listed_edit_is_refused_leaving_the_cache_as_it_was(saved: Path, tmp_path: Path, edit) -> None:
    folder = tmp_path / "snap"
    shutil.copytree(saved, folder)
    _resign(folder, edit)
    _, loaded = load_or_refuse(folder)
    assert loaded is None


def test_two_children_sharing_a_block_are_refused_for_that(saved: Path) -> None:
    manifest = json.loads((_version(saved) / snapshot.MANIFEST).read_text())["manifest"]
    _two_children_share(manifest)
    with pytest.raises(SnapshotError, match="with a sibling"):
        snapshot_manifest.check_nodes(manifest, 4, "edited")


def test_a_current_pointer_of_5000_characters_is_refused(saved: Path, tmp_path: Path) -> None:
    folder = tmp_path / "snap"
    shutil.copytree(saved, folder)
    (folder / snapshot.CURRENT).write_text(snapshot.VERSION_PREFIX + "a" * 5000 + "\n")
    _, loaded = load_or_refuse(folder)
    assert loaded is None


def test_the_checksum_is_recomputed_by_the_edits(saved: Path, tmp_path: Path) -> None:
    folder = tmp_path / "snap"
    shutil.copytree(saved, folder)
    _resign(folder, lambda m: m["nodes"][0].update(hit_count=m["nodes"][0]["hit_count"] + 1))
    document = json.loads((_version(folder) / snapshot.MANIFEST).read_text())
    assert document["checksum"]["xxh3_128"] == snapshot_folder.digest(snapshot_folder.canonical(document["manifest"]))
    assert load_or_refuse(folder)[1] is not None
