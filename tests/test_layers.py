"""The package's layers, checked from its source: every import points down, no module imports another's private
names, no modules import each other in a circle (inside a layer too), and no module grows past 600 lines.

Layers, lowest first: errors <- cache, host_allocator <- models, chat, distributed <- engine <- replay <- testing,
ray <- serve, integrations <- bench (it times the server too) <- cli <- the ``prefixcache`` facade.  A module may
import its own subpackage and any lower layer; models and chat, side by side, do not import each other (nor does
distributed); nothing inside the package imports the facade.

Inside the cache layer, two subpackages sit beside the core: ``cache.host`` (the host-memory tier) and
``cache.snapshot`` (the cache on disk).  The core imports neither, except its assembly (``cache.radix_cache``) and the
``prefixcache.cache`` facade; ``cache.snapshot`` may import ``cache.host`` (it saves the host runs), never the reverse;
neither imports the assembly or the facade.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "prefixcache"
LAYERS = {
    "prefixcache.errors": 0,
    "prefixcache.host_allocator": 1,
    "prefixcache.cache": 1,
    "prefixcache.models": 2,
    "prefixcache.chat": 2,
    "prefixcache.distributed": 2,
    "prefixcache.engine": 3,
    "prefixcache.replay": 4,
    "prefixcache.testing": 5,
    "prefixcache.ray": 5,
    "prefixcache.serve": 6,
    "prefixcache.integrations": 6,
    "prefixcache.bench": 7,
    "prefixcache.cli": 8,
    "prefixcache.__main__": 9,
    "prefixcache": 9,
}
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    """The layer unit a module belongs to: its subpackage, a top-level module, or the facade itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "prefixcache":
                # `from prefixcache import bench` names a submodule; any other name is the facade's.
                for alias in node.names:
                    sub = PACKAGE / alias.name
                    is_module = sub.is_dir() or sub.with_suffix(".py").exists()
                    out.append((node.lineno, f"prefixcache.{alias.name}" if is_module else "prefixcache"))
            else:
                out.append((node.lineno, node.module))
    return [(line, name) for line, name in out if name == "prefixcache" or name.startswith("prefixcache.")]


def upward_imports(source: str, module: str) -> list[str]:
    own = unit(module)
    problems = []
    for line, target in imported_modules(ast.parse(source)):
        other = unit(target)
        if other == own:
            continue
        if other not in LAYERS:
            problems.append(f"{module}:{line} imports {target}, which belongs to no layer")
        elif LAYERS[other] >= LAYERS[own]:
            problems.append(f"{module}:{line} imports {target} (layer {LAYERS[other]} >= its own {LAYERS[own]})")
    return problems


MODULES = sorted(PACKAGE.rglob("*.py"))


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in it: at the top, in a function, under TYPE_CHECKING),
    ``from package import submodule`` resolved to the submodule."""
    graph: dict[str, set[str]] = {}
    for module, source in sources.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in sources else node.module)
        graph[module] = {t for t in targets if t in sources and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def private_imports(source: str, module: str) -> list[str]:
    """``from other_module import _name``: a name another module keeps to itself."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prefixcache"):
            for alias in node.names:
                if alias.name.startswith("_") and node.module != module:
                    problems.append(f"{module}:{node.lineno} imports {node.module}.{alias.name}")
    return problems


def test_every_module_belongs_to_a_layer() -> None:
    assert [str(p) for p in MODULES if unit(module_name(p)) not in LAYERS] == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_point_down(path: Path) -> None:
    assert upward_imports(path.read_text(), module_name(path)) == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    sources = {module_name(p): p.read_text() for p in MODULES}
    assert import_cycles(import_graph(sources)) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_no_module_imports_another_modules_private_names(path: Path) -> None:
    assert private_imports(path.read_text(), module_name(path)) == []


def test_the_cycle_check_finds_a_circle_inside_one_layer_and_through_a_function_import() -> None:
    sources = {
        "prefixcache.engine.a": "from prefixcache.engine.b import B",
        "prefixcache.engine.b": "def f():\n    from prefixcache.engine import c",
        "prefixcache.engine.c": "import prefixcache.engine.a",
        "prefixcache.engine.d": "from prefixcache.engine.a import A",
        "prefixcache.cache.e": "",
    }
    assert import_cycles(import_graph(sources)) == [
        ["prefixcache.engine.a", "prefixcache.engine.b", "prefixcache.engine.c"]
    ]
    del sources["prefixcache.engine.c"]
    assert import_cycles(import_graph(sources)) == []


def private_attributes(source: str, module: str) -> list[str]:
    """``obj._name`` on anything but ``self`` or ``cls``: reaching into another object's private state."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                problems.append(f"{module}:{node.lineno} reads {ast.unparse(node)}")
    return problems


ENGINE_MODULES = [p for p in MODULES if module_name(p).startswith("prefixcache.engine")]


@pytest.mark.parametrize("path", ENGINE_MODULES, ids=lambda p: module_name(p))
def test_no_engine_module_reaches_into_another_objects_private_state(path: Path) -> None:
    assert private_attributes(path.read_text(), module_name(path)) == []


def test_the_private_state_check_catches_a_borrowed_private_method() -> None:
    source = "def f(self, runner):\n    self._ok()\n    runner._check_tokens([1])"
    assert private_attributes(source, "prefixcache.engine.batching") == [
        "prefixcache.engine.batching:3 reads runner._check_tokens"
    ]


def test_the_private_name_check_catches_a_borrowed_private_name() -> None:
    source = "from prefixcache.engine.runner import _drive\nfrom prefixcache.engine.core import EngineCore"
    assert private_imports(source, "prefixcache.engine.batching") == [
        "prefixcache.engine.batching:1 imports prefixcache.engine.runner._drive"
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_no_module_is_over_600_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_LINES


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("from prefixcache.engine.runner import PrefixCachingRunner", "prefixcache.cache.tree"),
        ("import prefixcache.replay.replayer", "prefixcache.engine.runner"),
        ("def f():\n    from prefixcache.cli import main", "prefixcache.models.llama"),
        ("from prefixcache import RadixCache", "prefixcache.replay.explain"),
        ("from prefixcache.chat.tokenizer import ByteTokenizer", "prefixcache.models.hf"),
        ("from prefixcache.models.base import CausalLM", "prefixcache.chat.tokenizer"),
        ("from prefixcache.bench.common import Table", "prefixcache.serve.app"),
    ],
)
def test_the_check_catches_an_upward_import(source: str, module: str) -> None:
    assert len(upward_imports(source, module)) == 1


CACHE_ASSEMBLY = {"prefixcache.cache", "prefixcache.cache.radix_cache"}
"""The cache modules that put the core and its two subpackages together."""
CACHE_MAY_IMPORT = {
    "core": {"core"},
    "assembly": {"core", "assembly", "host", "snapshot"},
    "host": {"core", "host"},
    "snapshot": {"core", "host", "snapshot"},
}
"""Which parts of the cache layer each part may import (see the module docstring)."""


def cache_part(module: str) -> str | None:
    """``"host"``, ``"snapshot"``, ``"assembly"`` or ``"core"`` for a module of the cache layer, None outside it."""
    if module in CACHE_ASSEMBLY:
        return "assembly"
    for sub in ("host", "snapshot"):
        if module == f"prefixcache.cache.{sub}" or module.startswith(f"prefixcache.cache.{sub}."):
            return sub
    return "core" if module.startswith("prefixcache.cache.") else None


def resolved_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """The package's modules imported anywhere in ``tree``, ``from package import submodule`` resolved to the
    submodule (from the files under the package)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                path = PACKAGE.parent.joinpath(*sub.split("."))
                out.append((node.lineno, sub if path.is_dir() or path.with_suffix(".py").exists() else node.module))
    return [(line, name) for line, name in out if name.startswith("prefixcache")]


def cache_imports_out_of_place(source: str, module: str) -> list[str]:
    own = cache_part(module)
    if own is None:
        return []
    problems = []
    for line, target in resolved_imports(ast.parse(source)):
        other = cache_part(target)
        if other is not None and other not in CACHE_MAY_IMPORT[own]:
            problems.append(
                f"{module}:{line} imports {target} (cache part {other!r}; {own!r} may import only "
                f"{sorted(CACHE_MAY_IMPORT[own])})"
            )
    return problems


CACHE_MODULES = [p for p in MODULES if cache_part(module_name(p)) is not None]


@pytest.mark.parametrize("path", CACHE_MODULES, ids=lambda p: module_name(p))
def test_inside_the_cache_only_the_assembly_imports_host_and_snapshot(path: Path) -> None:
    assert cache_imports_out_of_place(path.read_text(), module_name(path)) == []


def test_the_cache_has_its_core_and_two_subpackages() -> None:
    parts = {module_name(p): cache_part(module_name(p)) for p in CACHE_MODULES}
    assert {part for part in parts.values()} == {"core", "assembly", "host", "snapshot"}
    assert parts["prefixcache.cache.snapshot.host"] == "snapshot"
    assert parts["prefixcache.cache.host.tier"] == "host"
    assert parts["prefixcache.cache.tree"] == "core"


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("if TYPE_CHECKING:\n    from prefixcache.cache.host.tier import HostTier", "prefixcache.cache.admission"),
        ("from prefixcache.cache import snapshot", "prefixcache.cache.tree"),
        ("from prefixcache.cache.snapshot.tree import Snapshot", "prefixcache.cache.host.tier"),
        ("from prefixcache.cache.radix_cache import RadixCache", "prefixcache.cache.snapshot.cache"),
        ("from prefixcache.cache import KVBlockPool", "prefixcache.cache.host.pools"),
    ],
)
def test_the_cache_check_catches_a_core_module_reaching_out(source: str, module: str) -> None:
    assert len(cache_imports_out_of_place(source, module)) == 1


def test_the_cache_check_allows_the_directions_the_cache_has() -> None:
    allowed = {
        "prefixcache.cache.radix_cache": "from prefixcache.cache.host.tier import HostTier\n"
        "from prefixcache.cache.snapshot.cache import CacheSnapshots",
        "prefixcache.cache.snapshot.host": "from prefixcache.cache.host.tier import HostRun\n"
        "from prefixcache.cache.snapshot.tree import Snapshot\nfrom prefixcache.cache.tokens import TOKEN_TYPECODE",
        "prefixcache.cache.host.tier": "from prefixcache.cache.tree import RadixTree\nfrom prefixcache.errors import X",
        "prefixcache.cache": "from prefixcache.cache.host import make_host_pool",
    }
    assert [
        problem for module, source in allowed.items() for problem in cache_imports_out_of_place(source, module)
    ] == []


def test_the_check_allows_downward_and_sibling_imports() -> None:
    source = (
        "from prefixcache.cache.pool import KVBlockPool\nfrom prefixcache.engine.sampling import SamplingParams\n"
        "from prefixcache.errors import LockError\nfrom prefixcache import bench"
    )
    assert upward_imports(source, "prefixcache.engine.runner")[:1] == [
        "prefixcache.engine.runner:4 imports prefixcache.bench (layer 7 >= its own 3)"
    ]
    assert upward_imports(source.rsplit("\n", 1)[0], "prefixcache.engine.runner") == []
