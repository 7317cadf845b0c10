"""How a step's block tasks become attention calls that keep the GPU's SMs busy.

A fused kernel gives each tile of ``tile_rows`` rows of each (batch, head) a thread block: query tiles forward,
key tiles backward. A call of few heads and rows leaves SMs idle: after an all-to-all over 8 ranks, Llama-3-8B
at 32K over 64 ranks gives a call 4 heads of 2048 query rows, 64 blocks on an H200's 132 (the planner's
``plan/cost.occupancy``; measured there at 0.77 of the fused call with the host ahead). Where a call cannot fill
the GPU (``sm_share`` below 1), and only there:

- tasks of one step with the same shape and mask (an all-gather's two diagonal squares) run as one call,
  stacked in the batch dimension, each direction where that direction is short of blocks;
- a lone full block whose forward is short of blocks runs with its keys cut into ``key_parts`` equal runs,
  stacked the same way, and the parts' ``(out, lse)`` merged after the call (flash-decoding's split of the
  keys). Its backward already gives each key tile a block and stays one call.

Both give the results of the calls they replace: a stacked call computes each batch entry on its own; the
key parts merge exactly as a ring's blocks do (one more rounding of the block's ``out``, as a ring's two
blocks have). Rows are stacked as views where they are adjacent (as ``kernels/torch_sdpa`` folds a diagonal
run) and copied otherwise, O(rows x d) against O(rows x keys x d) compute.

Where the GPU is (``Gpu``): a real CUDA device's SM count; elsewhere none, so CPU runs and a fake-CUDA
rehearsal keep one call per task, unless a caller assumes one (``assumed_gpu``: the planner's dry run with
its profile's GPU, and the tests of these calls on CPU).

Off unless ``MCP_CONTEXT_SIZED_CALLS=1``. On an H200 (2026-11-27, torch 2.11, cuDNN) a P = 8 zigzag member of
8 query and 2 K/V heads, whose blocks cut their keys into 2 and 4 parts, gave ``out`` 5-8 % off fp64 attention,
while the same plan on a CPU with the calls sized for that GPU was exact: the split call handed cuDNN a query
stack copied head-major beside key and value views laid out token-major. Every stacked operand is now laid out
token-major (``stacked``, ``kernels.fold_rows``), as the single calls' are; whether that was the whole cause is
for the next GPU run (``tests/test_calls.py``, ``tests/test_results.py``), and until it passes the calls are
one per task, the form that ran exact on the H200. The planner prices what this switch runs
(``planned_calls``).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from ..kernels import Dropout, Kernel, fold_rows
from ..masks import BlockMask
from ..merge import merge_blocks_
from ..schedule import BlockTask
from ..switches import switch
from .results import FOLD, HOLD, folds
from .rotation import rows_of

TILE_ROWS = 128
"""Rows of a fused kernel's tile, and so of one thread block's share of a call: the Hopper kernels' tile at
head dim 128 (assumed, not read from cuDNN; the planner's profiles carry it as ``attention_tile_rows``)."""


@dataclass(frozen=True)
class Gpu:
    """What decides how many thread blocks fill a GPU: its SMs and the kernels' tile."""

    sm_count: int
    tile_rows: int = TILE_ROWS


@dataclass(frozen=True)
class Call:
    """One attention call: the step's tasks ``tasks`` (indices, stacked in this order), or one full task with
    its keys cut into ``key_parts`` equal runs (forward only)."""

    tasks: tuple[int, ...]
    key_parts: int = 1


_assumed: Optional[Gpu] = None
SIZED_CALLS_ENV = "MCP_CONTEXT_SIZED_CALLS"
"""``1``: calls sized to the GPU (not yet exact on a GPU: the module's note); ``0`` or unset: one call per task."""


def sized_calls_enabled() -> bool:
    """``MCP_CONTEXT_SIZED_CALLS`` (``0`` or ``1``; unset is ``0``)."""
    return switch(SIZED_CALLS_ENV, "one attention call per block task", "calls sized to the GPU's SMs", default=False)


@contextlib.contextmanager
def assumed_gpu(gpu: Optional[Gpu]) -> Iterator[None]:
    """Plan calls for ``gpu`` on any device while inside (None: as the device says)."""
    global _assumed
    before, _assumed = _assumed, gpu
    try:
        yield
    finally:
        _assumed = before


@functools.lru_cache(maxsize=None)
def _cuda_gpu(index: int) -> Gpu:
    return Gpu(torch.cuda.get_device_properties(index).multi_processor_count)


def gpu_of(x: torch.Tensor) -> Optional[Gpu]:
    """The GPU ``x`` is on (None on a CPU or for fake tensors), or the one assumed (``assumed_gpu``)."""
    if _assumed is not None:
        return _assumed
    if x.is_cuda and not is_fake(x):
        return _cuda_gpu(x.device.index if x.device.index is not None else torch.cuda.current_device())
    return None


def sm_share(mask: BlockMask, n: int, m: int, parallel: int, gpu: Gpu) -> float:
    """The share of ``gpu``'s SMs a call keeps busy whose rows are ``n`` (query rows forward; key rows
    backward, with ``mask.transposed``) against ``m``, ``parallel`` copies at once (batch x heads x stacked
    tasks). Each row tile is a thread block whose work is the tiles it visits; a call takes at least its
    busiest block's time and its total work over ``sm_count`` SMs, so the share is
    ``total / (sm_count x busiest)``, at most 1."""
    loads = mask.tile_loads(n, m, gpu.tile_rows)
    busiest = max(loads, default=0)
    if not busiest:
        return 1.0
    return min(1.0, parallel * mask.diagonal * sum(loads) / (gpu.sm_count * busiest))


def task_share(task: BlockTask, parallel: int, gpu: Gpu, forward: bool, key_parts: int = 1) -> float:
    """``sm_share`` of a call of ``task`` in one direction (backward: the key tiles, ``mask.transposed``),
    ``parallel`` copies of it, its keys cut into ``key_parts`` runs (that many more copies of fewer keys)."""
    n, m = task.q[1] - task.q[0], (task.kv[1] - task.kv[0]) // key_parts
    copies = parallel * key_parts
    return sm_share(task.mask, n, m, copies, gpu) if forward else sm_share(task.mask.transposed, m, n, copies, gpu)


def key_parts(task: BlockTask, parallel: int, gpu: Gpu) -> int:
    """How many equal key runs a full task's forward is cut into: as many as one wave of thread blocks holds
    (``parts x blocks <= sm_count``: more would only shorten a second wave, for more copies and merges), the
    keys cut evenly into runs of a tile at least; 1 where the task fills the GPU or is not a full block.
    64 blocks on 132 SMs: 2 parts."""
    if task.mask != BlockMask() or not task.useful_pairs:
        return 1
    blocks = parallel * -(-(task.q[1] - task.q[0]) // gpu.tile_rows)
    m = task.kv[1] - task.kv[0]
    parts = min(gpu.sm_count // blocks, m // gpu.tile_rows)
    while parts > 1 and m % parts:
        parts -= 1
    return max(parts, 1)


@functools.lru_cache(maxsize=4096)
def step_calls(tasks: tuple[BlockTask, ...], parallel: int, gpu: Gpu, forward: bool) -> tuple[Call, ...]:
    """The calls that run ``tasks`` (one step's) in one direction on ``gpu``, ``parallel`` = batch x heads: one
    per task where each fills the GPU; equal tasks short of blocks stacked, as many to a call as fill it once
    (``1 / sm_share``, rounded down: more would only save calls, for copies of their rows held at once), and a
    lone full task short of blocks split by keys (forward). Calls are in the order of their first task."""
    classes: dict[tuple, list[int]] = {}
    for i, t in enumerate(tasks):
        short = t.useful_pairs and task_share(t, parallel, gpu, forward) < 1.0
        key = (t.q[1] - t.q[0], t.kv[1] - t.kv[0], t.mask) if short else ("alone", i)
        classes.setdefault(key, []).append(i)
    calls = []
    for members in classes.values():
        first = tasks[members[0]]
        per_call = max(1, int(1.0 / task_share(first, parallel, gpu, forward))) if len(members) > 1 else 1
        for at in range(0, len(members), per_call):
            group = tuple(members[at:at + per_call])
            parts = key_parts(first, parallel, gpu) if forward and len(group) == 1 else 1
            calls.append(Call(group, parts))
    return tuple(sorted(calls, key=lambda c: c.tasks[0]))


def adjacent(spans: Sequence[tuple[int, int]]) -> bool:
    """Each span starts where the one before it ends."""
    return all(b0 == a1 for (_, a1), (b0, _) in zip(spans, spans[1:]))


def stacked(x: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Rows ``spans`` (equal lengths, dim 2) of ``x [b, h, s, ...]`` stacked in the batch dimension:
    ``[len(spans) * b, h, n, ...]``, token-major within each entry (what ``fold_rows`` gives); a copy of the rows
    where ``stacked_by_copy`` says, else a view. One layout for every operand of a call: cuDNN gave wrong results
    for a head-major query stack beside token-major keys (the module's note)."""
    n = spans[0][1] - spans[0][0]
    if adjacent(spans):
        return fold_rows(x.narrow(2, spans[0][0], n * len(spans)), len(spans))
    return torch.cat([x.narrow(2, a, n).transpose(1, 2) for a, _ in spans], dim=0).transpose(1, 2)


def stacked_by_copy(spans: Sequence[tuple[int, int]], batch: int) -> bool:
    """Whether ``stacked`` copies rows ``spans`` of a batch of ``batch``: where they are not ``adjacent``, or
    the batch is more than one (``fold_rows`` reshapes it)."""
    return batch > 1 or not adjacent(spans)


def unstacked(x: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """The inverse of ``stacked`` for a call's output ``[parts * b, ...]``: each part's ``[b, ...]`` view."""
    b = x.shape[0] // parts
    return [x.narrow(0, i * b, b) for i in range(parts)]


def merged_key_parts(out: torch.Tensor, lse: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(out, lse)`` of a block from its key parts' (``[parts * b, ...]``, ``key_parts``): merged into
    the first part's rows with one rounding of ``out``, as a row's blocks are (``results.folds``: one kernel for
    up to ``results.OUT_ARITY`` parts, an fp32 sum past that)."""
    outs, lses = unstacked(out, parts), unstacked(lse, parts)
    blocks = [x for pair in zip(outs, lses) for x in pair]
    o, l = outs[0], lses[0]
    acc: Optional[torch.Tensor] = None
    for k, (role, held, summed) in enumerate(folds(parts)):
        if role == HOLD:
            continue
        if acc is None and role == FOLD:
            acc = torch.empty(o.shape, dtype=l.dtype, device=o.device)
        merge_blocks_(acc if role == FOLD else o, l, *([acc, l] if summed else []), *blocks[2 * (k - held):2 * k + 2])
    return o, l


def parts_of(task: BlockTask, parts: int) -> list[tuple[int, int]]:
    """A task's key rows cut into ``parts`` equal runs."""
    step = (task.kv[1] - task.kv[0]) // parts
    return [(task.kv[0] + i * step, task.kv[0] + (i + 1) * step) for i in range(parts)]


@functools.lru_cache(maxsize=None)
def one_call_each(count: int) -> tuple[Call, ...]:
    """One call per task of a step of ``count`` tasks."""
    return tuple(Call((i,)) for i in range(count))


def planned_calls(tasks: Sequence[BlockTask], parallel: int, gpu: Gpu, forward: bool,
                  sized: Optional[bool] = None) -> tuple[Call, ...]:
    """The calls of a step on ``gpu``: ``step_calls`` where ``sized``, one per task where not; None, as
    ``MCP_CONTEXT_SIZED_CALLS`` says (the executor's ``calls_for``, the planner's prices and the timing tools'
    counts; a calibration against steps timed with or without the sized calls says which)."""
    if sized is None:
        sized = sized_calls_enabled()
    return step_calls(tuple(tasks), parallel, gpu, forward) if sized else one_call_each(len(tasks))


def pass_gpu(x: torch.Tensor, dropout: bool) -> Optional[Gpu]:
    """The GPU a pass over tensors like ``x`` sizes its calls for (``gpu_of``), none with dropout (each block
    replays its own mask): found once a pass, not once a step."""
    return None if dropout else gpu_of(x)


def calls_for(tasks: Sequence[BlockTask], parallel: int, gpu: Optional[Gpu], forward: bool) -> tuple[Call, ...]:
    """The calls of a step the executor runs: ``planned_calls`` on a GPU (``pass_gpu``), one call per task
    elsewhere."""
    return one_call_each(len(tasks)) if gpu is None else planned_calls(tasks, parallel, gpu, forward)


DropoutOf = Callable[[int], Optional[Dropout]]
"""A step's dropout by task index (None without dropout)."""


RowsOf = Callable[[torch.Tensor, tuple[int, int]], torch.Tensor]
"""Rows ``[a, b)`` (dim 2) of a ``[b, h, n, ...]`` tensor as a view: ``rotation.rows_of``, or a pass's
``rotation.HeldRows``."""


def forward_call(kernel: Kernel, call: Call, tasks: Sequence[BlockTask], q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, scale: float, dropout: DropoutOf, rows: RowsOf = rows_of) -> list[tuple]:
    """Run ``call``'s forward on ``q``, ``k``, ``v [b, h, s, d]``: ``(task, out, lse)`` for each of its tasks.
    ``dropout(task)``: that task's dropout; only a call of one task has any (``calls_for``). ``rows``: how a
    task's rows are viewed."""
    first = tasks[call.tasks[0]]
    if call.key_parts > 1:
        parts = parts_of(first, call.key_parts)
        o, l = kernel.forward(stacked(q, [first.q] * len(parts)), stacked(k, parts), stacked(v, parts), first.mask,
                              scale)
        return [(call.tasks[0], *merged_key_parts(o, l, len(parts)))]
    if len(call.tasks) == 1:
        i = call.tasks[0]
        return [(i, *kernel.forward(rows(q, first.q), rows(k, first.kv), rows(v, first.kv), first.mask,
                                    scale, dropout(i)))]
    group = [tasks[i] for i in call.tasks]
    qs, kvs = [t.q for t in group], [t.kv for t in group]
    o, l = kernel.forward(stacked(q, qs), stacked(k, kvs), stacked(v, kvs), first.mask, scale)
    return list(zip(call.tasks, unstacked(o, len(group)), unstacked(l, len(group))))


def backward_call(kernel: Kernel, call: Call, tasks: Sequence[BlockTask], dout: torch.Tensor, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse_rows: Callable[[tuple[int, int]], torch.Tensor], scale: float, dropout: DropoutOf,
                  rows: RowsOf = rows_of) -> list[tuple]:
    """Run ``call``'s backward: ``(task, dq, dk, dv)`` for each of its tasks. ``lse_rows(span)``: the final
    ``lse`` rows a block's backward reads; ``rows``: how a task's rows are viewed."""
    first = tasks[call.tasks[0]]
    if len(call.tasks) == 1:
        i, qs, kvs = call.tasks[0], first.q, first.kv
        return [(i, *kernel.backward(rows(dout, qs), rows(q, qs), rows(k, kvs), rows(v, kvs),
                                     rows(out, qs), lse_rows(qs), first.mask, scale, dropout(i)))]
    group = [tasks[i] for i in call.tasks]
    qs, kvs = [t.q for t in group], [t.kv for t in group]
    lse = torch.cat([lse_rows(span) for span in qs], dim=0)
    grads = kernel.backward(stacked(dout, qs), stacked(q, qs), stacked(k, kvs), stacked(v, kvs), stacked(out, qs),
                            lse, first.mask, scale)
    return list(zip(call.tasks, *(unstacked(x, len(group)) for x in grads)))
