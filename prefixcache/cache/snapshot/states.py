"""The recurrent states of a snapshot: a hybrid or state-space model's cache (``resume_states=True``,
:mod:`prefixcache.cache.resume`) saves the states kept on the nodes it saves, so a restarted process resumes them.

A saved state is a node record's entry in ``"states"``: ``{"position", "nbytes", "uses", "meta", "tensors"}`` — its
absolute position (inside the node's edge), its size and resume count (its value, kept across the restart), what the
state says of its own structure (JSON, ``meta``) and the names of its tensors in ``kv.safetensors`` (``state.<node
index>.<position>.<name>``), under the same checksums as the K/V.  A state takes part when it has a
``snapshot_parts() -> (meta, {name: tensor})`` method (:class:`~prefixcache.models.hf_state.RecurrentState` does; a
:class:`~prefixcache.cache.resume.StateMarker` saves only its size); one without is left out and counted.

Capture holds the states themselves, not copies: a state is immutable once handed to the cache, so the writer reads
its tensors (to the CPU) after the cache's mutex is released.  Restore rebuilds every state with the caller's
``state_loader(position, meta, tensors) -> state`` (the model's, putting the tensors on its device) *before* the cache
is touched, so a state the model refuses leaves the cache as it was, and a rebuilt state must measure the bytes its
record says (the budget counts those); without a loader a tensorless record comes back as a
:class:`~prefixcache.cache.resume.StateMarker` and the others are left out.  The states of the nodes restored are put
back within the budget (the least valuable evicted as usual); a cache that keeps no states ignores them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefixcache.cache.resume import StateMarker
from prefixcache.cache.snapshot.manifest import is_count
from prefixcache.errors import SnapshotCorruptError

if TYPE_CHECKING:
    from prefixcache.cache.node import Node
    from prefixcache.cache.resume import StateStore

__all__ = ["StateLoader", "capture_node", "check", "load", "put_back"]

StateLoader = Callable[[int, dict[str, Any], dict[str, Any]], Any]
"""``state_loader(position, meta, tensors)``: a state standing at ``position`` rebuilt from what its
``snapshot_parts()`` gave (tensors on the CPU).  Raises SnapshotMismatchError for parts it cannot take."""

PREFIX = "state."


def capture_node(store: StateStore | None, node: Node, index: int, tensors: dict[str, Any]) -> list[dict[str, Any]]:
    """The records of the states kept on ``node`` (saved as node ``index``), their tensors added to ``tensors`` by
    name; states without ``snapshot_parts`` are left out.  O(states on the node)."""
    if store is None or node.states is None:
        return []
    records = []
    for pos, state in sorted(node.states.items()):
        parts = getattr(state, "snapshot_parts", None)
        if isinstance(state, StateMarker):
            meta, named = {}, {}
        elif parts is None:
            continue
        else:
            meta, named = parts()
        names = []
        for local, tensor in named.items():
            name = f"{PREFIX}{index}.{pos}.{local}"
            tensors[name] = tensor
            names.append(name)
        nbytes, uses = store.filed(node, pos)
        records.append({"position": pos, "nbytes": nbytes, "uses": uses, "meta": meta, "tensors": names})
    return records


def check(manifest: dict[str, Any], tensor_names: set[str], where: str) -> None:
    """Every state record sits inside its node's edge with a size, a use count, a JSON ``meta`` and tensors the file
    holds.  O(states).

    Raises:
        SnapshotCorruptError: naming the first record that does not hold.
    """
    for index, record in enumerate(manifest["nodes"]):
        states = record.get("states", [])
        if type(states) is not list:
            raise SnapshotCorruptError(f"the snapshot {where}: node {index} has states {states!r}")
        end = record["start"] + len(record["tokens"])
        for entry in states:
            ok = (
                type(entry) is dict
                and is_count(entry.get("position"))
                and record["start"] < entry["position"] <= end
                and is_count(entry.get("nbytes"))
                and is_count(entry.get("uses"))
                and entry["uses"] >= 1
                and type(entry.get("meta")) is dict
                and type(entry.get("tensors")) is list
                and all(_named(n, index, entry["position"]) and n in tensor_names for n in entry["tensors"])
            )
            if not ok:
                raise SnapshotCorruptError(f"the snapshot {where}: node {index} holds a malformed state {entry!r:.200}")


def _named(name: object, index: int, position: int) -> bool:
    """Whether ``name`` is a tensor name :func:`capture_node` gives a state of node ``index`` at ``position``."""
    prefix = f"{PREFIX}{index}.{position}."
    return type(name) is str and name.startswith(prefix) and len(name) > len(prefix)


def load(manifest: dict[str, Any], tensors: dict[str, Any], loader: StateLoader | None) -> dict[int, list[tuple]]:
    """The saved states rebuilt, by node index: ``(position, state, nbytes, uses)``.  With a ``loader`` every record
    goes through it (a tensorless record too: the model refuses a state without its tensors, which a marker in its
    place would fail the first request resuming it), and the state it rebuilds must measure the record's
    ``nbytes`` (the budget counts them); with none only the tensorless ones come back (as markers).  Raises what the
    loader raises, SnapshotCorruptError for a size that disagrees (before the cache is touched)."""
    out: dict[int, list[tuple]] = {}
    for index, record in enumerate(manifest["nodes"]):
        for entry in record.get("states", ()):
            names = entry["tensors"]
            if loader is None:
                if names:
                    continue
                state = StateMarker(entry["nbytes"])
            else:
                local = {name.split(".", 3)[3]: tensors[name] for name in names}
                state = loader(entry["position"], entry["meta"], local)
                nbytes = getattr(state, "nbytes", None)
                if nbytes != entry["nbytes"]:
                    raise SnapshotCorruptError(
                        f"the snapshot's state at {entry['position']} (node {index}) records {entry['nbytes']} bytes; "
                        f"its tensors make {nbytes}"
                    )
            out.setdefault(index, []).append((entry["position"], state, entry["nbytes"], entry["uses"]))
    return out


def put_back(store: StateStore | None, built: dict[int, Node], states: dict[int, list[tuple]]) -> tuple[int, int]:
    """Put the rebuilt ``states`` of the nodes restored (``built``: record index -> node) into ``store``, shallowest
    first; returns ``(states kept, their bytes)``.  O(states log states)."""
    if store is None:
        return 0, 0
    entries = [(pos, index, state, nbytes, uses) for index, kept in states.items() for pos, state, nbytes, uses in kept]
    for pos, index, state, nbytes, uses in sorted(entries, key=lambda e: (e[0], e[1])):
        node = built.get(index)
        if node is not None:
            store.put(node, pos, state, nbytes, uses)
    kept = [(node, pos) for node in built.values() if node.states for pos in node.states]
    return len(kept), sum(store.filed(node, pos)[0] for node, pos in kept)
