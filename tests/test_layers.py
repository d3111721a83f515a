"""The package's layers, checked from its source: every import points down, no module imports another's private
names, no modules import each other in a circle (inside a layer too), and no module grows past 600 lines.

Layers, lowest first: errors <- cache, host_allocator <- models, chat, distributed <- engine <- replay <- bench,
testing, ray <- serve, integrations <- cli <- the ``prefixcache`` facade.  A module may import its own subpackage and
any lower layer; models and chat, side by side, do not import each other (nor does distributed); nothing inside the
package imports the facade.
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
    "prefixcache.bench": 5,
    "prefixcache.testing": 5,
    "prefixcache.ray": 5,
    "prefixcache.serve": 6,
    "prefixcache.integrations": 6,
    "prefixcache.cli": 7,
    "prefixcache.__main__": 8,
    "prefixcache": 8,
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
    ],
)
def test_the_check_catches_an_upward_import(source: str, module: str) -> None:
    assert len(upward_imports(source, module)) == 1


def test_the_check_allows_downward_and_sibling_imports() -> None:
    source = (
        "from prefixcache.cache.pool import KVBlockPool\nfrom prefixcache.engine.sampling import SamplingParams\n"
        "from prefixcache.errors import LockError\nfrom prefixcache import bench"
    )
    assert upward_imports(source, "prefixcache.engine.runner")[:1] == [
        "prefixcache.engine.runner:4 imports prefixcache.bench (layer 5 >= its own 3)"
    ]
    assert upward_imports(source.rsplit("\n", 1)[0], "prefixcache.engine.runner") == []
