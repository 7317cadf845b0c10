"""No file we ship unpickles without an allow-list: a checkpoint or cache from elsewhere must not run code.

Every ``.py`` under ``mcp_context/``, ``megatron_patches/`` and ``tools/`` is parsed, and any use of
``pickle.load``/``loads``, an ``Unpickler`` (of ``pickle`` or a drop-in such as ``dill``), a
``torch.load`` without ``weights_only=True`` or a ``numpy.load(..., allow_pickle=True)`` is reported
by file and line. The one place allowed to touch the unpickler is the allow-list module
``mcp_context/safe_pickle.py``. The scan follows import aliases (``import pickle as pk``,
``from torch import load``); the first test plants each pattern to show the scan finds it.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("mcp_context", "megatron_patches", "tools")
ALLOW_LIST_MODULE = "mcp_context/safe_pickle.py"
PICKLE_MODULES = {"pickle", "_pickle", "dill", "cloudpickle"}
UNPICKLING = {"load", "loads", "Unpickler", "_Unpickler"}
TORCH_LOADS = {"torch.load", "torch.serialization.load"}


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted name it stands for (``pk`` -> ``pickle``, ``load`` -> ``torch.load``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """``pk.Unpickler`` -> ``pickle.Unpickler`` through the file's imports; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([names.get(node.id, node.id), *reversed(parts)])


def _weights_only(call: ast.Call) -> bool:
    return any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def unsafe_unpickling(source: str, filename: str = "<source>") -> list[str]:
    """``line: what`` for every unpickling without an allow-list in ``source``."""
    tree = ast.parse(source, filename)
    names = _imported_names(tree)
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(k.arg == "allow_pickle" and isinstance(k.value, ast.Constant)
                                              and k.value.value is True for k in node.keywords):
            found.append(f"{node.lineno}: allow_pickle=True")
        if not isinstance(node, (ast.Attribute, ast.Name)) or isinstance(getattr(node, "ctx", None), ast.Store):
            continue
        dotted = _dotted(node, names)
        if dotted is None or (isinstance(node, ast.Name) and dotted == node.id):
            continue  # a plain local name, not an imported one
        module, _, attr = dotted.rpartition(".")
        if module in PICKLE_MODULES and attr in UNPICKLING:
            found.append(f"{node.lineno}: {dotted}")
        elif dotted in TORCH_LOADS:
            call = calls.get(id(node))
            if call is None or not _weights_only(call):
                found.append(f"{node.lineno}: {dotted} without weights_only=True")
    return sorted(set(found), key=lambda f: int(f.split(":")[0]))


def test_the_scan_finds_each_unsafe_pattern_and_passes_the_safe_ones():
    planted = {
        "import pickle\npickle.load(f)": ["2: pickle.load"],
        "import pickle as pk\nx = pk.loads(b)": ["2: pickle.loads"],
        "from pickle import Unpickler\nclass U(Unpickler): pass": ["2: pickle.Unpickler"],
        "import dill\ndill.load(f)": ["2: dill.load"],
        "import torch\ntorch.load(p)": ["2: torch.load without weights_only=True"],
        "import torch\ntorch.load(p, weights_only=False)": ["2: torch.load without weights_only=True"],
        "from torch import load\nload(p)": ["2: torch.load without weights_only=True"],
        "import torch\nf = torch.load\nf(p, weights_only=True)": ["2: torch.load without weights_only=True"],
        "import numpy as np\nnp.load(p, allow_pickle=True)": ["2: allow_pickle=True"],
    }
    for source, expected in planted.items():
        assert unsafe_unpickling(source) == expected, source
    safe = ("import pickle\nimport torch\nimport numpy as np\n"
            "torch.load(p, map_location='cpu', weights_only=True)\n"
            "except_ = pickle.UnpicklingError\npickle.dumps(x)\nnp.load(p)\n"
            "def load(p): return p\nload(1)\n")
    assert unsafe_unpickling(safe) == []


def test_no_unpickling_outside_the_allow_list_module():
    findings = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == ALLOW_LIST_MODULE:
                continue
            findings += [f"{rel}:{f}" for f in unsafe_unpickling(path.read_text(encoding="utf-8"), rel)]
    assert not findings, (
        "unpickling without an allow-list (a planted checkpoint or cache could run code); read through "
        f"{ALLOW_LIST_MODULE} or use torch.load(..., weights_only=True):\n  " + "\n  ".join(findings))
