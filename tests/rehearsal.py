"""Rehearse the CUDA path on a CPU-only torch: every ring member's schedule on fake CUDA tensors.

Under ``FakeTensorMode`` a tensor made with ``device="cuda"`` has a shape, a dtype, strides and a
device but no numbers, and every aten op runs only its shape function. So the ring executor, the
kernels' op calls (their schemas) and the merge run as on a GPU, and a wrong argument type, dtype,
shape or a CPU tensor mixed into the step raises here, before any GPU sees the code. Numbers, the
strides only CUDA kernels check, and anything a probe decides are not rehearsed (the registry trusts
declared capabilities under fake tensors and says so).

One member's step is run the way the one-GPU member harness runs it (``tests/test_member_schedules``):
member ``m`` of a ring of ``P / inner`` walks ``LocalRotation(m, ring)`` over every member's K/V shard
laid out on the device; ``inner = 2`` is one all-to-all rank of an ``a2a+p2p [2, P/2]`` member (its
``h / 2`` query heads and their KV heads). The autograd engine aborts the process on fake CUDA tensors
on the CPU wheel, so the backward is driven directly (``ring_backward``), never through autograd.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mcp_context.algorithms.executor import RingPlan, ring_backward, ring_forward
from mcp_context.algorithms.rotation import LocalRotation
from mcp_context.kernels import Kernel, get_kernel
from mcp_context.masks import CAUSAL, Mask, attention_mask, documents_mask
from mcp_context.schedule import layout_schedule

CUDA = torch.device("cuda")


@dataclass(frozen=True)
class Case:
    """One rehearsal: a sequence of ``seq_len`` tokens over ``cp`` ranks (``inner = 2``: a2a+p2p [2, cp/2])."""

    seq_len: int
    cp: int
    inner: int
    mask_name: str  # "causal", "window" (4095, 0) or "packed" (two causal documents, 3/4 and 1/4)
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16

    @property
    def batch(self) -> int:
        return 1 if self.mask_name == "packed" else 2  # a packed sequence is one sequence

    def mask(self) -> Mask:
        if self.mask_name == "causal":
            return CAUSAL
        if self.mask_name == "window":
            return attention_mask(True, (4095, 0))
        s = self.seq_len
        return documents_mask([0, s - s // 4, s], within=CAUSAL, seq_len=s)

    def __str__(self) -> str:
        comm = "p2p" if self.inner == 1 else f"a2a+p2p [{self.inner}, {self.cp // self.inner}]"
        return f"S={self.seq_len} P={self.cp} {comm} {self.mask_name} h={self.heads}/{self.kv_heads} d={self.head_dim}"


class RehearsalError(AssertionError):
    """What failed, where: the case, the kernel, the member and forward or backward, then torch's error."""


def _check(name: str, x: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(x.shape) != shape or x.dtype != dtype or x.device.type != "cuda":
        raise ValueError(f"{name} came back {tuple(x.shape)} {x.dtype} on {x.device}, expected {shape} {dtype} on cuda")


def rehearse_members(case: Case, kernel: Union[str, Kernel]) -> int:
    """Run every member's forward and backward of ``case`` on fake CUDA tensors with ``kernel`` (a backend
    name for ``get_kernel`` or a kernel); returns the number of block tasks run. Raises ``RehearsalError``
    naming the case, kernel, member and pass, with torch's error, when anything fails."""
    with FakeTensorMode():
        if isinstance(kernel, str):
            kernel = get_kernel(kernel, CUDA, case.dtype, head_dim=case.head_dim)
        schedule = layout_schedule("zigzag", case.cp, case.seq_len, case.mask(), case.inner,
                                   kernel.capabilities.masks)
        ring, b, d = schedule.ring_size, case.batch, case.head_dim
        h, h_kv = case.heads // case.inner, max(1, case.kv_heads // case.inner)
        rows = case.seq_len // ring

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, device=CUDA, dtype=case.dtype)

        k_all, v_all = empty(case.seq_len, b, h_kv, d), empty(case.seq_len, b, h_kv, d)  # every member's shard
        tasks = 0
        for member in range(ring):
            q, dout = empty(rows, b, h, d), empty(rows, b, h, d)
            plan = RingPlan.build(schedule.tasks[member], LocalRotation(member, ring), kernel, d ** -0.5, rows)
            tasks += sum(len(step) for step in schedule.tasks[member])
            where = f"rehearsal of {case} with {kernel.name}, member {member} of {ring}"
            phase = "forward"
            try:
                out, lse = ring_forward(q, k_all, v_all, plan)
                _check("out", out, (rows, b, h, d), case.dtype)
                _check("lse", lse, (b, h, rows), torch.float32)
                phase = "backward"
                dq, dk, dv, _ = ring_backward(dout, q, k_all, v_all, out, lse, plan)
                _check("dq", dq, tuple(q.shape), case.dtype)
                _check("dk", dk, tuple(k_all.shape), case.dtype)
                _check("dv", dv, tuple(v_all.shape), case.dtype)
            except Exception as err:  # noqa: BLE001 - every error is what the rehearsal reports
                raise RehearsalError(f"{where}, {phase}: {type(err).__name__}: {err}") from err
    return tasks
