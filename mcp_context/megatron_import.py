"""Import megatron-core with its jit fusions compiled at their first call, not at import.

megatron-core (0.16) decorates its fusions with ``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on
torch >= 2.2; each decoration loads torch's dynamo and inductor, whether or not the process ever calls a fusion
(a CPU run never does). On this project's 2-core CPU that was 2.5-3 s of every process that imports megatron-core
(its import took 4.6-5.0 s, 1.9-2.0 s without), and a test run starts such a process for every rank it launches.
``import_megatron_core`` imports ``megatron.core`` while ``torch.compile`` stands for ``compiled_at_first_call``, so
``jit_fuser`` becomes that: the first call of a fusion compiles it with the same arguments (``torch.compile`` itself
compiles only at the first call too) and every call after runs the compiled function. Our commands call it before
they import anything of megatron-core; where megatron-core is already imported (Megatron-LM's ``pretrain_gpt.py``
imports it first) it does nothing.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional


def compiled_at_first_call(compile_: Callable) -> Callable:
    """A stand-in for ``torch.compile`` (``compile_``) that compiles a function at its first call, with the
    arguments it was given, and calls the compiled function from then on (a plain function, so a decorated method
    binds as before)."""
    def stand_in(fn: Optional[Callable] = None, **options: Any) -> Callable:
        if fn is None:  # used as @torch.compile(...)
            return lambda f: stand_in(f, **options)
        compiled: Optional[Callable] = None

        @functools.wraps(fn)
        def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_(fn, **options)
            return compiled(*args, **kwargs)
        return first_call_compiles
    return stand_in


def import_megatron_core() -> None:
    """Import ``megatron.core`` with its ``jit_fuser`` compiling at first call (the module's note); nothing where
    it is imported already."""
    if "megatron.core" in sys.modules:
        return
    import torch

    compile_ = torch.compile
    torch.compile = compiled_at_first_call(compile_)
    try:
        import megatron.core  # noqa: F401  (sets megatron.core.jit.jit_fuser from torch.compile)
    finally:
        torch.compile = compile_
