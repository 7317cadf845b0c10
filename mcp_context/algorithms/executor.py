"""The one ring executor: walk a rotation, run each step's block tasks, merge into (out, lse).

Forward: every task's ``(out, lse)`` goes into fp32 accumulators (fp64 for fp64 input) allocated once
per call — copied where its query rows are written for the first time, merged otherwise. Backward
re-walks the same rotation and recomputes each block from the saved final ``(out, lse)`` (no O(s^2)
state), sending dK/dV home through the rotation. Every scheme (p2p, a2a, all_gather, hierarchical)
runs through this loop with a different rotation. Kernels read ``[b, h, s, d]`` views of the
``[s, b, h, d]`` inputs (no layout copies) and take GQA natively where they can.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ..kernels import Dropout, Kernel, accum_dtype, finite_lse_for_backward
from ..merge import merge_
from ..schedule import BlockTask
from .. import trace
from .rotation import LocalRotation, RingRotation


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


@dataclass(frozen=True)
class RingPlan:
    """What one member executes: its tasks per ring step, how shards arrive, and the kernel.

    ``first`` and ``covered`` are derived from ``tasks`` once (``RingPlan.build``)."""

    tasks: Sequence[Sequence[BlockTask]]
    rotation: Union[RingRotation, LocalRotation]
    kernel: Kernel
    scale: float
    first: tuple[tuple[bool, ...], ...]
    covered: bool
    dropout_p: float = 0.0
    dropout_seed: Optional[int] = None  # already distinct per rank; mixed with step and task here

    @classmethod
    def build(cls, tasks, rotation, kernel: Kernel, scale: float, rows: int, dropout_p: float = 0.0,
              dropout_seed: Optional[int] = None) -> "RingPlan":
        first = first_writes(tasks)
        return cls(tasks, rotation, kernel, scale, first, first_writes_cover(tasks, first, rows), dropout_p,
                   dropout_seed)

    def with_dropout_seed(self, seed: Optional[int]) -> "RingPlan":
        return RingPlan(self.tasks, self.rotation, self.kernel, self.scale, self.first, self.covered, self.dropout_p,
                        seed)

    def dropout(self, step: int, task: int) -> Optional[Dropout]:
        if self.dropout_p == 0.0:
            return None
        return Dropout(self.dropout_p, hash((self.dropout_seed, step, task)) & (2**63 - 1))


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 2, 0, 3)


def _sbhd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.permute(2, 0, 1, 3).to(dtype).contiguous()


def _accumulator(like: torch.Tensor, dtype: torch.dtype, fill: float, covered: bool) -> torch.Tensor:
    """An accumulator shaped like ``like``: uninitialised when every row gets a first write."""
    return like.new_empty(like.shape, dtype=dtype) if covered else like.new_full(like.shape, fill, dtype=dtype)


class RingAttention(torch.autograd.Function):
    """``(q [sq, b, h, d], k, v [sk, b, h_kv, d], plan) -> (out [sq, b, h, d], lse [b, h, sq])``."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan):
        qb = _bhsd(q)
        acc = accum_dtype(q.dtype)
        out = _accumulator(qb, acc, 0.0, plan.covered)
        lse = _accumulator(qb[..., 0], acc, float("-inf"), plan.covered)
        for step, kb, vb in plan.rotation.blocks(_bhsd(k), _bhsd(v)):
            t0 = trace.now()
            for i, t in enumerate(plan.tasks[step]):
                qs, ks = slice(*t.q), slice(*t.kv)
                o, l = plan.kernel.forward(qb[:, :, qs], kb[:, :, ks], vb[:, :, ks], t.mask, plan.scale,
                                           plan.dropout(step, i))
                if plan.first[step][i]:
                    out[:, :, qs].copy_(o)
                    lse[:, :, qs].copy_(l)
                else:
                    merge_(out[:, :, qs], lse[:, :, qs], o, l)
            trace.record("forward_compute", step, t0)
        out = _sbhd(out, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan: RingPlan = ctx.plan
        dout = dout.to(q.dtype).contiguous()
        qb, ob, dob = _bhsd(q), _bhsd(out), _bhsd(dout)
        lse = finite_lse_for_backward(lse)
        acc = accum_dtype(q.dtype)
        dq = _accumulator(qb, acc, 0.0, plan.covered)
        kb_all, vb_all = _bhsd(k), _bhsd(v)
        grads = plan.rotation.gradients(kb_all, acc)
        for step, kb, vb in plan.rotation.blocks(kb_all, vb_all):
            t0 = trace.now()
            dkv = grads.buffer(step)
            for i, t in enumerate(plan.tasks[step]):
                qs, ks = slice(*t.q), slice(*t.kv)
                gq, gk, gv = plan.kernel.backward(dob[:, :, qs], qb[:, :, qs], kb[:, :, ks], vb[:, :, ks],
                                                  ob[:, :, qs], lse[:, :, qs], t.mask, plan.scale,
                                                  plan.dropout(step, i))
                if plan.first[step][i]:
                    dq[:, :, qs].copy_(gq)
                else:
                    dq[:, :, qs] += gq
                dkv[0, :, :, ks] += gk
                dkv[1, :, :, ks] += gv
            trace.record("backward_compute", step, t0)
            grads.done(step, dkv)
        dk, dv = grads.result()
        return _sbhd(dq, q.dtype), _sbhd(dk, k.dtype), _sbhd(dv, v.dtype), None
