"""Package names that load on first use (PEP 562), so importing a package costs only what is used.

``import mcp_context.recipes`` and the recipe commands need neither torch nor megatron-core; a package
``__init__`` lists where each public name lives and hands its ``__getattr__``/``__dir__`` to this.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, homes: dict[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public names live in ``homes`` (name -> relative
    module); a name is imported once, then kept in ``namespace`` (the package's globals)."""
    def getattr_(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name], package), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return getattr_, dir_
