"""The one ring executor: walk a rotation, run each step's block tasks, merge into (out, lse).

Forward: every task's ``(out, lse)`` goes into fp32 accumulators (fp64 for fp64 input) allocated once
per call — copied where its query rows are written for the first time, merged otherwise. Backward
re-walks the same rotation and recomputes each block from the saved final ``(out, lse)`` (no O(s^2)
state), sending dK/dV home through the rotation. Every scheme (p2p, a2a, all_gather, hierarchical)
runs through this loop with a different rotation. Kernels read ``[b, h, s, d]`` views of the
``[s, b, h, d]`` inputs (no layout copies) and take GQA natively where they can. Keys and values
keep their own head dims (MLA: ``dqk != dv``). An attention sink (softmax offset) is merged once
into the final ``(out, lse)``, so every block's backward already sees sink-normalised probabilities.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..kernels import Dropout, Kernel, accum_dtype, finite_lse_for_backward
from ..merge import add_sink_, merge_, sink_grad
from ..schedule import BlockTask
from .. import trace
from .rotation import Rotation, rows_of


def first_writes(tasks: Sequence[Sequence[BlockTask]]) -> tuple[tuple[bool, ...], ...]:
    """Per step and task: True when no earlier task wrote any of its query rows (copy, not merge)."""
    written: list[tuple[int, int]] = []
    flags = []
    for step in tasks:
        row = []
        for t in step:
            row.append(all(t.q[1] <= a or b <= t.q[0] for a, b in written))
            written.append(t.q)
        flags.append(tuple(row))
    return tuple(flags)


def first_writes_cover(tasks: Sequence[Sequence[BlockTask]], first: Sequence[Sequence[bool]], rows: int) -> bool:
    """Whether the first-write tasks alone cover all ``rows`` local rows, so every row is copied into
    before anything merges into it and the accumulators need no initial fill."""
    seen = [False] * rows
    for step, flags in zip(tasks, first):
        for t, is_first in zip(step, flags):
            if is_first:
                seen[t.q[0]:t.q[1]] = [True] * (t.q[1] - t.q[0])
    return all(seen)


def most_blocks_per_key(tasks: Sequence[Sequence[BlockTask]]) -> int:
    """The most tasks of one step that read the same key row: how many block dK/dV a row's sum adds here."""
    most = 0
    for step in tasks:
        edges = sorted([(t.kv[0], 1) for t in step] + [(t.kv[1], -1) for t in step])
        depth = 0
        for _, d in edges:  # an end sorts before a start at the same row: touching ranges do not overlap
            depth += d
            most = max(most, depth)
    return most


@dataclass(frozen=True)
class RingPlan:
    """What one member executes: its tasks per ring step, how shards arrive, and the kernel.

    ``first``, ``covered`` and ``kv_sums_exact`` are derived from ``tasks`` once (``RingPlan.build``).
    ``merges``: some query row meets more than one block. Without merges (a ring of one running one call,
    or disjoint query runs) every row's result is one block's, so ``out`` and dQ are written straight in
    the inputs' dtype (no fp32 round trip, no final copy where the kernel's output is already token-major).
    ``kv_sums_exact``: every dK/dV sum is complete on this member (``rotation.complete_sums``) and adds at
    most two blocks, so summing in the inputs' half precision rounds exactly as fp32 then one cast would
    (two bf16 numbers add exactly in fp32 arithmetic before the one rounding): the all-gather's plans, whose
    fp32 dK/dV buffer over the whole sequence was the largest thing they held."""

    tasks: Sequence[Sequence[BlockTask]]
    rotation: Rotation
    kernel: Kernel
    scale: float
    first: tuple[tuple[bool, ...], ...]
    covered: bool
    dropout_p: float = 0.0
    dropout_seed: Optional[int] = None  # already distinct per rank; mixed with step and task here
    kv_sums_exact: bool = False

    @property
    def merges(self) -> bool:
        return not all(all(step) for step in self.first)

    @classmethod
    def build(cls, tasks, rotation, kernel: Kernel, scale: float, rows: int, dropout_p: float = 0.0,
              dropout_seed: Optional[int] = None) -> "RingPlan":
        first = first_writes(tasks)
        exact = rotation.complete_sums and most_blocks_per_key(tasks) <= 2
        return cls(tasks, rotation, kernel, scale, first, first_writes_cover(tasks, first, rows), dropout_p,
                   dropout_seed, exact)

    def with_dropout_seed(self, seed: Optional[int]) -> "RingPlan":
        return dataclasses.replace(self, dropout_seed=seed)

    def kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype dK/dV are summed in for inputs of ``dtype``."""
        return dtype if self.kv_sums_exact and dtype in (torch.bfloat16, torch.float16) else accum_dtype(dtype)

    def dropout(self, step: int, task: int) -> Optional[Dropout]:
        if self.dropout_p == 0.0:
            return None
        return Dropout(self.dropout_p, hash((self.dropout_seed, step, task)) & (2**63 - 1))


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 2, 0, 3)


def _token_major(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``x [b, h, s, d]`` as an ``[s, b, h, d]`` view when its storage is token-major and packed (the
    executor's accumulators; a fused op's output for token-major inputs), else None."""
    y = x.permute(2, 0, 1, 3)
    return y if y.is_contiguous() else None


def _sbhd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [b, h, s, d]`` as an ``[s, b, h, d]``-contiguous tensor of ``dtype``: a view when ``x`` is already
    that (a result written straight in the inputs' dtype), else one copy kernel (transpose and cast together)."""
    same = _token_major(x) if x.dtype == dtype else None
    if same is not None:
        return same
    b, h, s, d = x.shape
    out = x.new_empty((s, b, h, d), dtype=dtype)
    _copy_(_bhsd(out), x)
    return out


def _sbhd_view(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [b, h, s, d]`` as ``[s, b, h, d]``: a view when it is already in ``dtype`` (dK or dV as columns of a
    token-major packed buffer: strided, not packed), else ``_sbhd``'s copy. For the gradients of K and V:
    whatever reads them next copies anyway (the all-gather's reorder, a collective's ``contiguous``), so a
    packing copy here would move every byte twice."""
    return x.permute(2, 0, 1, 3) if x.dtype == dtype else _sbhd(x, dtype)


# Rows are taken with ``narrow`` (``rotation.rows_of``) and copied with the aten op: Python indexing,
# ``Tensor.copy_`` and ``Tensor.contiguous`` take a device guard that fake CUDA tensors on a CPU-only torch
# (the rehearsal, tests/test_cuda_rehearsal.py) do not have.
_copy_ = torch.ops.aten.copy_.default


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _accumulator(like: torch.Tensor, shape: tuple, dtype: torch.dtype, fill: float, covered: bool) -> torch.Tensor:
    """An accumulator of ``shape`` on ``like``'s device: uninitialised when every row gets a first write.

    A ``[b, h, s, d]`` accumulator is stored token-major (``[s, b, h, d]``, viewed): the order of the
    inputs and of the fused ops' outputs, so the merges, adds and the final copy stream through memory
    in the same order as what they read (a transposed read or write ran the merge at a third of the
    memory bandwidth on an H200)."""
    stored = (shape[2], shape[0], shape[1], shape[3]) if len(shape) == 4 else shape
    x = like.new_empty(stored, dtype=dtype) if covered else like.new_full(stored, fill, dtype=dtype)
    return _bhsd(x) if len(shape) == 4 else x


def _adopt_lse(l: torch.Tensor, rows: int, dtype: torch.dtype) -> bool:
    """Whether a first block's ``lse`` can serve as the accumulator itself (no copy): it covers every row,
    is in the accumulator dtype and is packed (a fused op's fresh output)."""
    return l.shape[-1] == rows and l.dtype == dtype and l.is_contiguous()


class _BackwardLse:
    """The final ``lse`` as each block's backward reads it: ``-inf`` made ``+inf`` (fully masked rows get
    zero probabilities, never NaN) and packed, one kernel per distinct query span (a fused op's backward
    wants its ``lse`` rows contiguous; a narrowed ``[b, h, s]`` is not)."""

    def __init__(self, lse: torch.Tensor):
        self.lse, self.spans = lse, {}

    def rows(self, span: tuple[int, int]) -> torch.Tensor:
        if span not in self.spans:
            self.spans[span] = finite_lse_for_backward(self.lse.narrow(2, span[0], span[1] - span[0]))
        return self.spans[span]


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan,
                 sink: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [sq, b, h, dqk]``, ``k [sk, b, h_kv, dqk]``, ``v [sk, b, h_kv, dv]`` -> ``out [sq, b, h, dv]``
    (q's dtype) and ``lse [b, h, sq]`` (accumulator dtype). ``sink [h]``: a per-head attention sink
    (softmax offset), merged once into the final result (``merge.add_sink_``).

    Work outside the attention calls: a first write copies a block's ``out`` into the fp32 accumulator
    (its ``lse`` is adopted as the accumulator when it covers every row), every later block is one
    fused merge, and the result is one copy into ``[s, b, h, dv]``. A plan without merges (and no sink)
    writes ``out`` in q's dtype: one copy per block, none for one token-major block over every row."""
    qb = _bhsd(q)
    acc = accum_dtype(q.dtype)
    b, h, sq, _ = qb.shape
    direct = not plan.merges and sink is None  # every row is one block's: no accumulation, no rounding
    shape, dtype = (b, h, sq, v.shape[-1]), q.dtype if direct else acc
    out: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    for step, kb, vb in plan.rotation.blocks(_bhsd(k), _bhsd(v)):
        t0 = trace.now()
        for i, t in enumerate(plan.tasks[step]):
            o, l = plan.kernel.forward(rows_of(qb, t.q), rows_of(kb, t.kv), rows_of(vb, t.kv), t.mask, plan.scale,
                                       plan.dropout(step, i))
            if lse is None and plan.first[step][i] and _adopt_lse(l, sq, acc):  # a first block over every row
                lse = l
                if direct and o.dtype == q.dtype and _token_major(o) is not None:
                    out = o  # the one block over every row is the result
                else:
                    out = _accumulator(qb, shape, dtype, 0.0, True)
                    _copy_(out, o)
                continue
            if out is None:
                out = _accumulator(qb, shape, dtype, 0.0, plan.covered)
            if lse is None:
                lse = _accumulator(qb, (b, h, sq), acc, float("-inf"), plan.covered)
            if plan.first[step][i]:
                _copy_(rows_of(out, t.q), o)
                _copy_(rows_of(lse, t.q), l)
            else:
                merge_(rows_of(out, t.q), rows_of(lse, t.q), o, l)
        trace.record("forward_compute", step, t0)
    if lse is None:  # no task at all (every row masked): zeros, lse -inf
        out, lse = _accumulator(qb, shape, dtype, 0.0, False), qb.new_full((b, h, sq), float("-inf"), dtype=acc)
    if sink is not None:
        add_sink_(out, lse, sink)
    return _sbhd(out, q.dtype), lse


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, plan: RingPlan, sink: Optional[torch.Tensor] = None):
    """The gradients ``dq, dk, dv`` (the inputs' dtypes) and ``dsink`` (``sink``'s dtype, or None) from the
    final ``out [sq, b, h, dv]`` and ``lse [b, h, sq]`` of ``ring_forward``: every block is recomputed and
    its dK/dV travel home through the rotation. With a sink, ``out``/``lse`` already include it, so each
    block's probabilities are the sink-normalised ones and no block needs to know about it.

    Work outside the attention calls: one kernel per distinct query span for the blocks' ``lse``, one
    per block for dQ (a copy on a first write, else an add) and one per block for dK/dV (``Gradients.add``),
    and one copy each for the ``[s, b, h, d]`` results. Without merges dQ is written in q's dtype (none
    for one token-major block over every row), and a gradient walk may hand a lone block's dK/dV back
    as they are (``LocalGradients``)."""
    dout = _contiguous(dout.to(q.dtype))
    qb, ob, dob = _bhsd(q), _bhsd(out), _bhsd(dout)
    block_lse = _BackwardLse(lse)
    acc = accum_dtype(q.dtype)
    direct = not plan.merges
    dq: Optional[torch.Tensor] = None
    kb_all, vb_all = _bhsd(k), _bhsd(v)
    grads = plan.rotation.gradients(kb_all, vb_all, plan.kv_dtype(k.dtype))
    for step, kb, vb in grads.blocks(kb_all, vb_all):
        t0 = trace.now()
        for i, t in enumerate(plan.tasks[step]):
            gq, gk, gv = plan.kernel.backward(rows_of(dob, t.q), rows_of(qb, t.q), rows_of(kb, t.kv),
                                              rows_of(vb, t.kv), rows_of(ob, t.q), block_lse.rows(t.q), t.mask,
                                              plan.scale, plan.dropout(step, i))
            if direct and t.q == (0, qb.shape[2]) and gq.dtype == q.dtype and _token_major(gq) is not None:
                dq = gq  # the one block over every row is the result
                grads.add(step, t.kv, gk, gv)
                continue
            if dq is None:
                dq = _accumulator(qb, tuple(qb.shape), q.dtype if direct else acc, 0.0, plan.covered)
            if plan.first[step][i]:
                _copy_(rows_of(dq, t.q), gq)
            else:
                rows_of(dq, t.q).add_(gq)
            grads.add(step, t.kv, gk, gv)
        trace.record("backward_compute", step, t0)
        grads.done(step)
        del kb, vb  # the walk frees a shard's message once it is sent, not when the next one arrives
    if dq is None:  # no task at all: no gradient reaches q
        dq = _accumulator(qb, tuple(qb.shape), q.dtype, 0.0, False)
    dk, dv = grads.result()
    dsink = None if sink is None else sink_grad(dob, ob, finite_lse_for_backward(lse), sink).to(sink.dtype)
    return _sbhd(dq, q.dtype), _sbhd_view(dk, k.dtype), _sbhd_view(dv, v.dtype), dsink


class RingAttention(torch.autograd.Function):
    """``(q [sq, b, h, dqk], k [sk, b, h_kv, dqk], v [sk, b, h_kv, dv], plan, sink [h] or None)
    -> (out [sq, b, h, dv], lse [b, h, sq])``; differentiable in q, k, v and the sink."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, sink: Optional[torch.Tensor] = None):
        out, lse = ring_forward(q, k, v, plan, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv, dsink = ring_backward(dout, q, k, v, out, lse, ctx.plan, sink)
        return dq, dk, dv, None, dsink
