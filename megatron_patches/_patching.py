"""The one mechanism every patch in this package uses to replace an attribute of megatron-core.

`replace_attribute` swaps a function or method for a replacement, remembers the original on the
replacement (so callers and tests can reach it with `original_of`), refuses to patch twice (so every
`apply_*` is idempotent), and, for module-level functions, rebinds the aliases that other modules
made with ``from module import name`` before the patch ran. It owns no knowledge of what is patched
or why; that lives in the patch modules.
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable, ContextManager

_ORIGINAL_ATTR = "__megatron_patches_original__"


def _function_of(attribute: Any) -> Any:
    """The plain function behind a class attribute (unwraps staticmethod / classmethod)."""
    if isinstance(attribute, (staticmethod, classmethod)):
        return attribute.__func__
    return attribute


def original_of(owner: Any, name: str) -> Any:
    """The attribute `owner.name` had before this package patched it (itself if never patched)."""
    current = owner.__dict__[name]
    return getattr(_function_of(current), _ORIGINAL_ATTR, current)


def is_patched(owner: Any, name: str) -> bool:
    """Whether `owner.name` is a replacement installed by `replace_attribute`."""
    return hasattr(_function_of(owner.__dict__.get(name)), _ORIGINAL_ATTR)


def qualified_name(owner: Any, name: str) -> str:
    """``package.module.name`` or ``package.module.Class.name``, for reports."""
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def replace_attribute(owner: Any, name: str, make_replacement: Callable[[Any], Callable]) -> bool:
    """Replace `owner.name` (a module or class attribute) with `make_replacement(original)`.

    `original` is the plain function (staticmethod / classmethod wrappers are unwrapped, and
    re-applied around the replacement). Returns False, changing nothing, when `owner.name` is
    already a replacement; True when it patched now.
    """
    if name not in owner.__dict__:
        raise AttributeError(
            f"{getattr(owner, '__name__', owner)!r} has no attribute {name!r} to patch; this "
            "megatron-core version is not one megatron_patches knows, check the patch docstrings"
        )
    if is_patched(owner, name):
        return False
    current = owner.__dict__[name]
    original = _function_of(current)
    replacement = make_replacement(original)
    setattr(replacement, _ORIGINAL_ATTR, original)
    if isinstance(current, staticmethod):
        installed: Any = staticmethod(replacement)
    elif isinstance(current, classmethod):
        installed = classmethod(replacement)
    else:
        installed = replacement
    setattr(owner, name, installed)
    if isinstance(owner, types.ModuleType):
        _rebind_aliases(original, replacement)
    return True


def _rebind_aliases(original: Any, replacement: Any) -> None:
    """Point every module-level alias of `original` (``from m import f`` copies) at `replacement`."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for alias, value in list(namespace.items()):
            if value is original:
                namespace[alias] = replacement


def run_inside(context: Callable[[], ContextManager]) -> Callable[[Callable], Callable]:
    """A ``make_replacement`` for ``replace_attribute``: the original, run inside a fresh ``context()``."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def run(*args: Any, **kwargs: Any) -> Any:
            with context():
                return original(*args, **kwargs)

        return run

    return make
