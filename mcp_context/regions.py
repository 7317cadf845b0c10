"""Elementwise regions (the merge, the dQ sum, the dK/dV adds) compiled once on CUDA, and called without
dynamo's per-call Python where a call repeats a layout dynamo has already seen.

A region is a plain torch function that writes its first operands in place. On CUDA it runs as one
compiled kernel (``torch.compile`` with its automatic dynamic shapes: each size a constant until a call changes
it, then that size symbolic); elsewhere, and on fake tensors, eagerly. On an H200 (2026-11-27,
``docs/gpu/h200_run5_regions.log``) the kernels with every size symbolic ran the ring step's merges at a fifth
to half of the memory bandwidth (a flat index divided by runtime head and row counts), those with only the rows
symbolic at 0.8-1.0 of the per-shape kernels: the merge of the sum and three blocks 132 -> 31 µs, of five blocks
73 -> 38 µs, the dK/dV first write 58 -> 17 µs. Through
``torch.compile`` every call goes through dynamo's frame wrappers, its guards and AOTAutograd's runtime
wrapper before Inductor's launcher: on an H200's host (run 4, cProfile) 240-300 µs a call, of which Inductor's
own call was 94 µs; a ring step at 32K/P8 makes 17 such calls, and its host issue time (7.75 ms) was on a
par with its GPU time. So each compiled variant is recorded as dynamo compiles it (``_Variant``: the
compiled function and how its graph's inputs are read from the operands), and every call through dynamo
notes the variant its guards picked. A later call whose operands have exactly that layout (``layout_key``:
each operand's dtype, device, sizes, strides, storage offset, ``requires_grad`` and view base, which of them
are the same tensor or share storage, and grad mode: everything dynamo's guards read) calls that variant
directly, with the inputs dynamo would pass. Inductor's code still checks every input's sizes and strides.
``MCP_CONTEXT_DIRECT_REGIONS=0`` sends every call through dynamo (the same kernels).

If compiling fails the eager form runs from then on, with one warning naming the reason (same results,
slower).
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from .errors import first_line
from .switches import switch

RECOMPILE_LIMIT = 64
"""The variants one region may compile in a process. Each dtype, aliasing and size-1 pattern of its operands
is one variant (a bf16 p2p step makes three merges); a process that runs several dtypes, head counts or
schemes (a test run, a benchmark over a grid) makes more than torch's default of 8 per function. Past that
default a ``fullgraph`` region raises ``FailOnRecompileLimitHit`` (torch 2.11 on an H200, a test run,
2026-11-26), which made every later merge of the process eager: the region recompiles under this limit
instead."""

DIRECT_ENV = "MCP_CONTEXT_DIRECT_REGIONS"
"""``0`` sends every compiled region's call through ``torch.compile``'s wrappers (the same kernels; for
comparing, or if direct calls misbehave on a machine); ``1`` or unset: a layout seen before is called
directly."""

LAYOUTS_KEPT = 4096
"""Layouts one region remembers for direct calls; past that, new layouts go through dynamo (a training run
meets a few dozen; a test run over many shapes may meet more)."""


_direct = True


def direct_calls_enabled() -> bool:
    """``MCP_CONTEXT_DIRECT_REGIONS`` (``0`` or ``1``; unset is ``1``), no ``through_dynamo()`` in effect, and no
    torch function or dispatch mode active (a mode sees the ops of a call through dynamo, not a direct one's)."""
    return _direct and switch(DIRECT_ENV, "every compiled call through torch.compile's wrappers",
                              "a layout seen before called directly") \
        and not torch._C._len_torch_function_stack() and not torch._C._len_torch_dispatch_stack()


@contextlib.contextmanager
def through_dynamo() -> Iterator[None]:
    """Send every compiled call through ``torch.compile``'s wrappers while inside (what ``tools/host_costs.py``
    compares direct calls against)."""
    global _direct
    before, _direct = _direct, False
    try:
        yield
    finally:
        _direct = before


def layout_key(args: Sequence[torch.Tensor]) -> tuple:
    """What dynamo's guards read of ``args``, exactly: per operand its dtype, sizes, strides, storage offset and
    ``requires_grad``; the device; grad mode; and where operands share storage, which are the same tensor,
    which share it and their view bases' sizes and strides. Two calls with equal keys pass the same guards.
    (Dynamo also guards global state that cannot change a pointwise region's kernel: autocast, deterministic
    algorithms, the default dtype.)"""
    storages = [t.untyped_storage().data_ptr() for t in args]
    shared = None
    if len(set(storages)) < len(storages):  # aliasing (an accumulator merged in place): rare, described fully
        ids = [id(t) for t in args]
        shared = (tuple(map(ids.index, ids)), tuple(map(storages.index, storages)),
                  tuple(None if t._base is None else (t._base.shape, t._base.stride()) for t in args))
    return (tuple((t.dtype, t.shape, t.stride(), t.storage_offset(), t.requires_grad) for t in args),
            args[0].device, torch.is_grad_enabled(), shared)


class _Variant:
    """One compiled variant of a region (what the backend returned to dynamo) and where each of its graph's
    inputs comes from (``sources``: dynamo's, None where this torch does not say): an operand, or a size,
    stride or offset of one (a direct call passes the values of the layout it was recorded for)."""

    def __init__(self, compiled: Callable, sources: Optional[list], names: Sequence[str]):
        self.compiled = compiled  # called as dynamo calls a backend's function: the graph's inputs as arguments
        self.sources, self.names = sources, list(names)

    def __call__(self, *graph_inputs):
        _noted.variant = self  # dynamo picked this variant for the operands being called
        return self.compiled(*graph_inputs)

    def bound(self, args: Sequence[torch.Tensor]) -> Optional["_Direct"]:
        """A direct call for operands laid out as ``args``, or None where a graph input is read in a way this
        does not know (that layout keeps going through dynamo)."""
        if self.sources is None:
            return None
        slots, consts = [], []
        for source in self.sources:
            place = _read(source, self.names, args)
            if place is None:
                return None
            slots.append(place[0])
            consts.append(place[1])
        return _Direct(self.compiled, slots, consts)


def _operand(source, names: list[str]) -> Optional[int]:
    """The operand position a dynamo source names: a parameter (``names``), or an item of a trailing ``*args``
    parameter (listed ``"*args"`` last, as ``Region.names`` does); None for any other source."""
    from torch._dynamo.source import GetItemSource, LocalSource

    if isinstance(source, LocalSource) and source.local_name in names:
        return names.index(source.local_name)
    if isinstance(source, GetItemSource) and isinstance(source.base, LocalSource) and not source.index_is_slice \
            and names[-1] == f"*{source.base.local_name}" and isinstance(source.index, int):
        return len(names) - 1 + source.index
    return None


def _read(source, names: list[str], args: Sequence[torch.Tensor]):
    """``(operand position, None)`` for a graph input that is an operand, ``(-1, value)`` for one that is a
    size, stride or storage offset of one (its value in ``args``), None for any other source."""
    from torch._dynamo.source import TensorProperty, TensorPropertySource

    at = _operand(source, names)
    if at is not None:
        return at, None
    at = _operand(source.base, names) if isinstance(source, TensorPropertySource) else None
    if at is not None:
        t = args[at]
        if source.prop == TensorProperty.SIZE:
            return -1, t.size(source.idx)
        if source.prop == TensorProperty.STRIDE:
            return -1, t.stride(source.idx)
        if source.prop == TensorProperty.STORAGE_OFFSET:
            return -1, t.storage_offset()
    return None


class _Direct:
    """A variant's call for one layout: the operands in their graph positions, the layout's sizes beside them."""

    def __init__(self, compiled: Callable, slots: list[int], consts: list):
        self.compiled, self.slots, self.consts = compiled, slots, consts

    def __call__(self, args: Sequence[torch.Tensor]) -> bool:
        """Run it; False where Inductor's input checks (every input's sizes and strides: the first thing its code
        does, before any write) refuse these operands."""
        try:
            self.compiled(*[args[s] if s >= 0 else c for s, c in zip(self.slots, self.consts)])
        except AssertionError:
            return False
        return True


_noted = threading.local()  # the variant the last call through dynamo ran, per thread (backward runs on its own)


class Region:
    """``eager`` run as one compiled kernel on CUDA (automatic dynamic shapes, up to ``RECOMPILE_LIMIT`` variants;
    a layout seen before called directly), eagerly elsewhere.

    A fake-CUDA rehearsal cannot compile, so it runs eagerly too."""

    def __init__(self, eager: Callable, what: str):
        self.eager, self.what = eager, what
        self.names = [f"*{p.name}" if p.kind is p.VAR_POSITIONAL else p.name  # ``*blocks``: the operands past the others
                      for p in inspect.signature(eager).parameters.values()]
        self.compiled: Optional[Callable] = None
        self.error: Optional[str] = None
        self.compiling = True
        self.direct: dict[tuple, Optional[_Direct]] = {}  # layout_key -> its direct call (None: through dynamo)
        self.devices = ("cuda",)  # where it compiles (a test adds the CPU: Inductor compiles C++ there)
        self.backend = "inductor"  # the dynamo backend that compiles each variant
        self.dynamic: Optional[bool] = None  # torch.compile's: None automatic, False per shape, True all symbolic

    @contextlib.contextmanager
    def eagerly(self) -> Iterator[None]:
        """Run the eager form on CUDA too while inside (``tools/host_costs.py`` weighs the compiled
        region's host cost against the eager form's kernels)."""
        before, self.compiling = self.compiling, False
        try:
            yield
        finally:
            self.compiling = before

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list) -> _Variant:
        from torch._dynamo.backends.registry import lookup_backend

        try:
            sources = [node.meta["grapharg"].source for node in graph.graph.nodes if node.op == "placeholder"]
        except (KeyError, AttributeError):  # a torch that keeps no sources: every call goes through dynamo
            sources = None
        return _Variant(lookup_backend(self.backend)(graph, example_inputs), sources, self.names)

    def compile(self) -> Callable:
        """The region through ``torch.compile`` (built once; sizes as ``dynamic`` says; each variant it compiles is
        recorded for direct calls)."""
        if self.compiled is None:
            self.compiled = torch.compile(self.eager, backend=self._backend, dynamic=self.dynamic, fullgraph=True)
        return self.compiled

    def run_compiled(self, *args: torch.Tensor) -> None:
        """The region through dynamo; a variant past torch's recompile limit is compiled under
        ``RECOMPILE_LIMIT`` (the limit is read only when a call compiles, so calls of known variants pay
        nothing for it). Dynamo is imported here, with the first compiled call, not with this module: a process
        that never compiles (the CPU, a planner) does not load it (2-3 s of a 2-core CPU's time a process)."""
        from torch._dynamo.exc import FailOnRecompileLimitHit

        try:
            self.compile()(*args)
        except FailOnRecompileLimitHit:  # raised before the variant ran: nothing is written yet
            with torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)):
                self.compile()(*args)

    def _direct_call(self, args: Sequence[torch.Tensor]) -> Optional[_Direct]:
        """The direct call the variant dynamo just ran gives for ``args``' layout (None: keep going through dynamo,
        also where this torch's sources are read differently)."""
        variant = _noted.variant
        try:
            return None if variant is None else variant.bound(args)
        except Exception:  # noqa: BLE001 - an unknown source kind or attribute: the layout stays with dynamo
            return None

    def __call__(self, *args: torch.Tensor) -> None:
        first = args[0]
        if first.device.type == "meta":  # a planner's dry run: no values to write, and the GPU's compiled kernel
            return  # allocates nothing (the eager form's temporaries are not the GPU's; they were 60 % of a plan's time)
        if not (self.compiling and self.error is None and first.device.type in self.devices
                and (type(first) is torch.Tensor or not is_fake(first))):
            self.eager(*args)
            return
        key = layout_key(args) if direct_calls_enabled() else None
        direct = self.direct.get(key)
        if direct is not None:
            if direct(args):
                return
            self.direct[key] = None  # refused before writing: this layout goes through dynamo from now on
        _noted.variant = None
        try:
            self.run_compiled(*args)
        except Exception as err:  # noqa: BLE001 - compilation fails before anything is written
            self.error = first_line(err)
            warnings.warn(f"torch.compile of the {self.what} failed ({self.error}); running it eagerly "
                          f"(slower, same results)", stacklevel=2)
            self.eager(*args)
            return
        if key is not None and key not in self.direct and len(self.direct) < LAYOUTS_KEPT:
            self.direct[key] = self._direct_call(args)
