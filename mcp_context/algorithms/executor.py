"""The one ring executor: walk a rotation, run each step's block tasks, merge into (out, lse).

Forward: for every step, every task's ``(out, lse)`` is merged into fp32 accumulators (fp64 for
fp64 input). Backward re-walks the same rotation and recomputes each block from the saved final
``(out, lse)`` — no O(s^2) state is kept — sending dK/dV home through the rotation. Every scheme
(p2p, a2a, all_gather, hierarchical) runs through this one loop with a different rotation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ..kernels import Dropout, Kernel, accum_dtype
from ..merge import merge_
from ..schedule import BlockTask
from . import timeline
from .rotation import LocalRotation, RingRotation


@dataclass(frozen=True)
class RingPlan:
    """What one member executes: its tasks per ring step, how shards arrive, and the kernel."""

    tasks: Sequence[Sequence[BlockTask]]
    rotation: Union[RingRotation, LocalRotation]
    kernel: Kernel
    scale: float
    dropout_p: float = 0.0
    dropout_seed: Optional[int] = None  # already distinct per rank; mixed with step and task here

    def dropout(self, step: int, task: int) -> Optional[Dropout]:
        if self.dropout_p == 0.0:
            return None
        return Dropout(self.dropout_p, hash((self.dropout_seed, step, task)) & (2**63 - 1))


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 2, 0, 3)


def _sbhd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.permute(2, 0, 1, 3).to(dtype).contiguous()


def _pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.stack([_bhsd(k), _bhsd(v)])  # [2, b, h_kv, s, d]


class RingAttention(torch.autograd.Function):
    """``(q [sq, b, h, d], k, v [sk, b, h_kv, d], plan) -> (out [sq, b, h, d], lse [b, h, sq])``."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan):
        qb = _bhsd(q)
        acc = accum_dtype(q.dtype)
        out = qb.new_zeros(qb.shape, dtype=acc)
        lse = qb.new_full(qb.shape[:3], float("-inf"), dtype=acc)
        for step, kv in plan.rotation.blocks(_pack_kv(k, v)):
            t0 = timeline.now()
            for i, t in enumerate(plan.tasks[step]):
                qs, ks = slice(*t.q), slice(*t.kv)
                o, l = plan.kernel.forward(qb[:, :, qs], kv[0, :, :, ks], kv[1, :, :, ks], t.causal, plan.scale,
                                           plan.dropout(step, i))
                merge_(out[:, :, qs], lse[:, :, qs], o, l)
            timeline.record("forward_compute", step, t0)
        out = _sbhd(out, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan: RingPlan = ctx.plan
        qb, ob, dob = _bhsd(q), _bhsd(out), _bhsd(dout)
        acc = accum_dtype(q.dtype)
        dq = qb.new_zeros(qb.shape, dtype=acc)
        kv = _pack_kv(k, v)
        grads = plan.rotation.gradients(kv, acc)
        for step, kv in plan.rotation.blocks(kv):
            t0 = timeline.now()
            dkv = kv.new_zeros(kv.shape, dtype=acc)
            for i, t in enumerate(plan.tasks[step]):
                qs, ks = slice(*t.q), slice(*t.kv)
                gq, gk, gv = plan.kernel.backward(dob[:, :, qs], qb[:, :, qs], kv[0, :, :, ks], kv[1, :, :, ks],
                                                  ob[:, :, qs], lse[:, :, qs], t.causal, plan.scale,
                                                  plan.dropout(step, i))
                dq[:, :, qs] += gq
                dkv[0, :, :, ks] += gk
                dkv[1, :, :, ks] += gv
            timeline.record("backward_compute", step, t0)
            grads.add(step, dkv)
        dkv = grads.result()
        return _sbhd(dq, q.dtype), _sbhd(dkv[0], k.dtype), _sbhd(dkv[1], v.dtype), None
