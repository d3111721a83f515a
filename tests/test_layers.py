"""The package's layers, checked from its source: every import points down, and no module grows past 600 lines.

Layers, lowest first: errors <- cache <- models, chat, distributed <- engine <- replay <- bench, testing, ray <-
serve, integrations <- cli <- the ``prefixcache`` facade.  A module may import its own subpackage and any lower layer;
models and chat, side by side, do not import each other (nor does distributed); nothing inside the package imports
the facade.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "prefixcache"
LAYERS = {
    "prefixcache.errors": 0,
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


def test_every_module_belongs_to_a_layer() -> None:
    assert [str(p) for p in MODULES if unit(module_name(p)) not in LAYERS] == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_point_down(path: Path) -> None:
    assert upward_imports(path.read_text(), module_name(path)) == []


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
