"""No module of the package imports one from a layer above it.

The layers, bottom first, are the ones ``docs/design.md`` lists: dependency-free helpers, then the
engine's stack (kernels, merge, layouts, schedule, comm, algorithms, engine and API), the Megatron
integration, recipes, data, the entry points (Megatron-LM translation, pretrain, convert, plan), and
on top the self-test (it reuses the planner's dry run). A package's command (its ``__main__``) stands
on its package's floor: a command that composes packages above its own belongs on the entry points'
floor (``python -m mcp_context.megatron_lm``). Every import is read from the source —
top-level, inside functions and under ``TYPE_CHECKING`` alike, relative ones resolved — so a late
import cannot hide an arrow that runs up.
A module may import its own layer only inside its own package (``pretrain`` from ``pretrain``).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mcp_context"

LAYERS = [
    ["cp_rules", "trace", "atomic", "safe_pickle", "masks", "lazy", "errors", "switches", "megatron_import"],
    ["kernels"],
    ["regions"],
    ["merge"],
    ["layouts"],
    ["schedule"],
    ["comm"],
    ["algorithms"],
    ["engine"],
    ["api"],
    ["megatron"],
    ["recipes"],
    ["data"],
    ["megatron_lm", "pretrain", "convert", "plan"],  # the entry points, and the commands composing packages
    ["selftest"],
]


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _place(module: str) -> tuple[int, str]:
    """``(layer, top-level package)`` of an ``mcp_context`` module; a package's ``__main__`` (its command)
    stands on its package's floor."""
    top = module.split(".")[1]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i, top
    raise AssertionError(f"{module} is in no layer: add {top!r} to LAYERS here and to docs/design.md")


def _imports(path: Path) -> set[str]:
    """Every ``mcp_context`` module ``path`` imports, with relative imports resolved."""
    package = _module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {f"{module}.{a.name}" for a in node.names} if not node.module else {module}
    return {m for m in found if m.startswith("mcp_context.")}


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_one_above_it(path):
    """Every file, commands included; the package's ``__init__`` is the public face (nothing inside
    imports it). A command imports the floors below it and its own package; nothing imports a command."""
    layer, top = _place(_module(path))
    wrong = []
    for imported in sorted(_imports(path)):
        other, other_top = _place(imported)
        if other > layer or (other == layer and other_top != top):
            wrong.append(f"{imported} (layer {other}: {LAYERS[other]})")
    assert not wrong, f"{_module(path)} (layer {layer}) imports {wrong}"


def test_a_command_stands_on_its_packages_floor():
    """So the recipes' command cannot print Megatron-LM flags (that translation sits two floors up)."""
    assert _place("mcp_context.recipes.__main__") == (LAYERS.index(["recipes"]), "recipes")
    layer, _ = _place("mcp_context.recipes.__main__")
    assert _place("mcp_context.megatron_lm")[0] > layer


def test_the_design_doc_draws_the_floors_top_down_in_this_order():
    text = (REPO / "docs" / "design.md").read_text()
    order = [text.index(f"\n{name}") for name in ("masks.py", "kernels/", "regions.py", "merge.py", "layouts.py", "schedule.py",
                                                   "comm/", "algorithms/", "engine.py", "api.py", "  megatron/")]
    assert order == sorted(order, reverse=True)


def test_nothing_imports_a_command():
    importers = [f"{_module(p)} imports {m}" for p in SOURCES for m in _imports(p) if m.endswith("__main__")]
    assert not importers, importers
