"""Bytes and memory of one attention layer, taken from the real engine run on meta tensors.

The planner does not carry its own byte formulas: for a candidate layout it runs the engine's
scheme (``resolve_scheme(...).run``) forward and backward, once per CP rank, on ``meta`` tensors (shapes and
dtypes, no data) under torch's in-process *fake* process group of the CP size (every collective and
point-to-point op returns at once). The comm layer counts what it sends exactly as in a real run
(``mcp_context.trace.comm_stats``: bytes, destinations and calls per operation, so the planner can split
bytes into intra- and inter-node traffic), and ``StorageBytes`` follows every storage the engine
allocates (peak and what stays saved for backward: the figures of torch's ``MemTracker`` at a
fraction of its cost per op). The kernel is
the fused CPU attention op, whose meta function allocates what a fused kernel returns (no O(s^2)
scores); the fused regions (merges, sums) do nothing on meta tensors (``regions.Region``), as compiled on a
GPU they allocate nothing.

This module owns the fake world and the per-rank dry run; it does not
decide which layouts are valid (``candidates.py``) or what they cost (``cost.py``).
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..algorithms import resolve_scheme
from ..algorithms.calls import Gpu, assumed_gpu
from ..comm import build_hcp_groups
from ..kernels.torch_sdpa import FUSED_OPS, TorchKernel, cpu_flash_kernel
from ..masks import Mask
from ..trace import comm_stats


@dataclass(frozen=True)
class RankShape:
    """One CP rank's attention inputs after tensor parallelism (heads already divided by TP)."""

    seq_len: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    """Query/key head dim."""
    dtype: torch.dtype = torch.bfloat16
    v_head_dim: Optional[int] = None
    """Value head dim (MLA: unlike head_dim); None: head_dim."""

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


@dataclass
class RankTraffic:
    """What one CP rank sends and holds in one attention layer's forward and backward."""

    cp_rank: int
    forward: dict[str, int]
    backward: dict[str, int]
    destinations: dict[str, dict[int, int]] = field(default_factory=dict)
    """Operation -> {destination CP rank: bytes}, forward and backward (weights for the intra/inter split)."""
    calls_forward: dict[str, int] = field(default_factory=dict)
    """Operation -> how many times this rank made it in forward (one ring transfer each)."""
    calls_backward: dict[str, int] = field(default_factory=dict)
    saved_bytes: int = 0
    """Bytes allocated by the layer that are still alive after forward (inputs included)."""
    peak_bytes: int = 0
    """Peak bytes allocated during forward and backward (inputs and output gradient included)."""
    tasks: tuple = ()
    """The block tasks this rank's executor runs, per step (``RingPlan.tasks``)."""
    q_rows: int = 0
    """Query rows the executor holds (the shard, times the all-to-all degree)."""
    kv_rows: int = 0
    """Key/value rows whose dK/dV the executor accumulates (the whole sequence after an all-gather)."""
    captures: bool = False
    """Nothing the step does crosses processes, so it can be replayed from a CUDA graph (``step_graphs``;
    ``rotation.Rotation.captures``: the K/V-local schemes)."""


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """An in-process fake default process group: this process plays ``rank`` of ``world_size``."""
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  (registers the "fake" backend)

    if dist.is_initialized():
        raise RuntimeError("the planner's dry run needs a process without a torch.distributed default group; "
                           "run it in its own process (python -m mcp_context.plan ...)")
    dist.init_process_group("cpu:fake,meta:fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        with _native_stderr_silenced():  # c10 warns "No backend of type 0 found" for every fake group
            dist.destroy_process_group()


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 (where C++ warnings go) to /dev/null for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


class StorageBytes(TorchDispatchMode):
    """Bytes held by the storages that ops create while active: ``current`` and ``peak``.

    A storage counts from the first op that returns a tensor on it until it is freed (a weak
    reference's callback), at its size in bytes (updated when an op returns it resized). This is
    what torch's ``MemTracker`` reports as the device total (meta tensors are not rounded), without
    its module, optimizer and per-category bookkeeping, which cost the planner more than the ops
    themselves.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        self.peak = max(self.peak, self.current)
        return out

    def _track(self, st: torch.UntypedStorage) -> None:
        key, nbytes = id(st), st.nbytes()
        known = self._sizes.get(key)  # a live storage's id is not reused: _free runs when it dies
        if known is None:
            self._sizes[key] = (weakref.ref(st, lambda _, key=key: self._free(key)), nbytes)
            self.current += nbytes
        elif known[1] != nbytes:  # grown or shrunk in place (Tensor.resize_)
            self._sizes[key] = (known[0], nbytes)
            self.current += nbytes - known[1]

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key)[1]


MAX_TENSOR_BYTES = 2**62
"""Largest q/k/v/out tensor a dry run makes: torch computes a storage's byte size in int64."""


def check_dry_run_fits(shape: RankShape) -> None:
    """Raise ``ValueError`` naming the planner's flags when the largest tensor of a dry run (q or
    k/v at CP = 1, the largest candidate) would hold more bytes than ``MAX_TENSOR_BYTES``."""
    itemsize = torch.empty((), dtype=shape.dtype).element_size()
    head_dim = max(shape.head_dim, shape.dv)
    nbytes = shape.seq_len * shape.batch * max(shape.heads, shape.kv_heads) * head_dim * itemsize
    if nbytes > MAX_TENSOR_BYTES:
        raise ValueError(
            f"--seq-len {shape.seq_len} x --micro-batch-size {shape.batch} x {max(shape.heads, shape.kv_heads)} heads "
            f"per TP rank x head dim {head_dim} x {itemsize} bytes = {nbytes} bytes for one attention input, "
            f"above 2**62 bytes (torch sizes storage in int64); lower --seq-len or --micro-batch-size")


def dry_run_kernel(shape: RankShape):
    """The fused op whose working memory the dry run measures: the CPU flash op, or, for a value head
    dim unlike q/k's (MLA), cuDNN's (the GPU op that takes it, DeepSeek-V3's 192/128 on Hopper; the
    CPU flash op does not). On meta tensors either runs its shape function only."""
    if shape.dv == shape.head_dim:
        return cpu_flash_kernel()
    return TorchKernel(FUSED_OPS["cudnn"])


def dry_run_rank(comm: str, sizes: Sequence[int], layout: str, mask: Mask, shape: RankShape,
                 cp_rank: int, gpu: Optional[Gpu] = None) -> RankTraffic:
    """Run one attention layer's forward and backward as CP rank ``cp_rank`` of ``prod(sizes)`` with
    ``mask`` (causal/full as a bool, or a ``masks`` value such as a sliding window), its calls planned for
    ``gpu`` (``algorithms/calls.py``: the stacked rows and key parts of calls that cannot fill it; None: one
    call per task)."""
    check_dry_run_fits(shape)
    cp_size = 1
    for s in sizes:
        cp_size *= s
    s_local = shape.seq_len // cp_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fake_world(cp_size, cp_rank), assumed_gpu(gpu):
            groups = build_hcp_groups(list(sizes))
            tracker = StorageBytes()
            comm_stats.reset()
            with tracker:
                q, k, v = (torch.empty(s_local, shape.batch, h, d, device="meta", dtype=shape.dtype, requires_grad=True)
                           for h, d in ((shape.heads, shape.head_dim), (shape.kv_heads, shape.head_dim),
                                        (shape.kv_heads, shape.dv)))
                scheme = resolve_scheme(groups, comm, layout, mask, s_local, shape.kv_heads, dry_run_kernel(shape),
                                        shape.head_dim ** -0.5)
                out = scheme.run(q, k, v, False)
                saved = tracker.current
                forward, _, calls_forward = comm_stats.snapshot()
                out.backward(torch.empty_like(out))
            total, destinations, calls = comm_stats.snapshot()
            peak = tracker.peak
    backward = dict(Counter(total) - Counter(forward))
    calls_backward = dict(Counter(calls) - Counter(calls_forward))
    q_rows = s_local * scheme.inner
    kv_rows = shape.seq_len if scheme.gather is not None else q_rows
    return RankTraffic(cp_rank, forward, backward, destinations, calls_forward, calls_backward, saved, peak,
                       tuple(tuple(step) for step in scheme.plan.tasks), q_rows, kv_rows, scheme.plan.rotation.captures)
