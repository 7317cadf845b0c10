"""``--simulate``: every CP member's schedule run in one process on one device.

NCCL refuses two ranks on one GPU and gloo cannot send CUDA tensors, so a CP=8 plan is checked on one
device the way the GPU tests check it: ring member ``m`` runs its schedule row through
``LocalRotation(m, ring)`` over every member's K/V shard laid out locally, and each all-to-all rank of
a level-0 group (``a2a+p2p``, ``a2a``) runs its slice of the heads (KV heads repeated when fewer than
the all-to-all degree, as the engine does). The schedule, kernel, executor and merge are the engine's
own; what is not exercised is the communication itself (the distributed run checks that).

The result is gathered back into full-sequence tensors in the layout the engine was told, so a
planted fault (data sliced in another layout, a wrong scale or a dropped sink on one rank, another
packing on one member) shows up exactly as it would across ranks.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..algorithms.executor import RingAttention, RingPlan
from ..algorithms.rotation import LocalRotation
from ..cp_rules import a2a_degree
from ..kernels import get_kernel
from ..layouts import spans_positions
from ..masks import Mask, attention_mask, documents_mask
from ..schedule import Schedule, layout_schedule
from .faults import FAULTY_RANK, scale_on_rank, sink_on_rank, sliced_layout
from .setup import AttentionKind, Setup, perturbed_documents


def kind_mask(kind: AttentionKind, seq_len: int, documents: tuple) -> Mask:
    """The engine's mask for ``kind``: causal or the window, inside each document when packed."""
    within = attention_mask(True, kind.window)
    if not kind.packed:
        return within
    return documents_mask(list(documents[0]), list(documents[1]), within=within, seq_len=seq_len)


def blocks_per_row(schedule: Schedule) -> tuple[int, int]:
    """The most block partials summed into one query row and into one key row, over every member."""
    seq_len = sum(s.count for spans in schedule.member_spans for s in spans)
    positions = [spans_positions(spans) for spans in schedule.member_spans]
    q_blocks, k_blocks = torch.zeros(seq_len, dtype=torch.long), torch.zeros(seq_len, dtype=torch.long)
    for member, steps in enumerate(schedule.tasks):
        for step, tasks in enumerate(steps):
            for t in tasks:
                q_blocks[positions[member][slice(*t.q)]] += 1
                k_blocks[positions[schedule.kv_source(member, step)][slice(*t.kv)]] += 1
    return max(1, int(q_blocks.max())), max(1, int(k_blocks.max()))


def cp_schedule(setup: Setup, kind: AttentionKind, kernel_masks: frozenset, cp_size: Optional[int] = None,
                inner: Optional[int] = None, layout: Optional[str] = None, documents: Optional[tuple] = None
                ) -> Schedule:
    """The schedule the engine runs for ``kind`` (the setup's CP sizes, comm and layout unless given)."""
    cp = setup.cp_size if cp_size is None else cp_size
    inner = a2a_degree(setup.comm, setup.sizes) if inner is None else inner
    mask = kind_mask(kind, setup.seq_len, setup.documents if documents is None else documents)
    return layout_schedule(setup.layout if layout is None else layout, cp, setup.seq_len, mask, inner, kernel_masks)


def simulate_attention(setup: Setup, kind: AttentionKind, dtype: torch.dtype, data: dict,
                       fault: Optional[str] = None, cp_size: Optional[int] = None, inner: Optional[int] = None,
                       layout: Optional[str] = None, timed: bool = False) -> dict:
    """Every member's forward and backward of ``kind`` on ``data`` (``random_inputs``), gathered into
    full-sequence fp64 tensors ``out, lse, dq, dk, dv`` (and ``dsink``), plus ``blocks`` (the most
    partials summed per query row and per key row) and ``seconds`` (member 0's forward+backward).

    ``cp_size``/``inner``/``layout`` override the setup's (``cp_size=1``: one fused call over the whole
    sequence, the half-precision yardstick). ``timed``: member 0 runs once more first, so ``seconds``
    leaves out first-call costs (kernel dispatch per block shape, allocations)."""
    cp = setup.cp_size if cp_size is None else cp_size
    inner = a2a_degree(setup.comm, setup.sizes) if inner is None else inner
    layout = setup.layout if layout is None else layout
    device = torch.device(setup.device)
    seq_len = setup.seq_len
    kernel = get_kernel("auto", device, dtype, head_dim=setup.head_dim, v_head_dim=setup.v_head_dim)
    schedule = cp_schedule(setup, kind, kernel.capabilities.masks, cp, inner, layout)
    data_layout = sliced_layout(layout, kind.packed, fault)
    data_schedule = schedule if data_layout == layout else cp_schedule(setup, kind, kernel.capabilities.masks, cp,
                                                                         inner, data_layout)
    faulty_member = None
    if fault == "cu-seqlens-differ":
        faulty_member = FAULTY_RANK // inner
        faulty_tasks = cp_schedule(setup, kind, kernel.capabilities.masks, cp, inner, layout,
                                   perturbed_documents(setup.documents)).tasks
    ring = schedule.ring_size
    place = [spans_positions(spans) for spans in schedule.member_spans]        # where the engine puts rows
    rows = [spans_positions(spans) for spans in data_schedule.member_spans]    # where the data came from
    order, placed = torch.cat(rows), torch.cat(place)

    heads, kv_heads = data["q"].shape[2], data["k"].shape[2]
    kv_repeat = inner // kv_heads if kv_heads < inner else 1
    q, dout = (data[n].to(device, dtype) for n in ("q", "dout"))
    k_all, v_all = (data[n].repeat_interleave(kv_repeat, dim=2)[order].to(device, dtype).requires_grad_()
                    for n in ("k", "v"))
    sink_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    sink = None if data["sink"] is None else data["sink"].to(device, sink_dtype).detach().clone().requires_grad_()
    hq, hk = heads // inner, k_all.shape[2] // inner
    scale = setup.head_dim ** -0.5
    full = {"out": torch.zeros(seq_len, q.shape[1], heads, setup.v_head_dim, dtype=torch.float64),
            "lse": torch.zeros(seq_len, q.shape[1], heads, dtype=torch.float64),
            "dq": torch.zeros(seq_len, q.shape[1], heads, setup.head_dim, dtype=torch.float64)}

    def run_rank(member: int, j: int):
        """CP rank ``member * inner + j``: its forward and backward, its output, lse, dq, and seconds."""
        cp_rank = member * inner + j
        tasks = faulty_tasks[member] if member == faulty_member else schedule.tasks[member]
        qh, kh = slice(j * hq, (j + 1) * hq), slice(j * hk, (j + 1) * hk)
        plan = RingPlan.build(tasks, LocalRotation(member, ring), kernel, scale_on_rank(scale, cp_rank, fault),
                              len(place[member]))
        q_local = q[rows[member]][:, :, qh].detach().requires_grad_()
        member_sink = sink_on_rank(sink, cp_rank, fault)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, lse = RingAttention.apply(q_local, k_all[:, :, kh], v_all[:, :, kh], plan,
                                       None if member_sink is None else member_sink[qh])
        out.backward(dout[rows[member]][:, :, qh])
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out, lse, q_local.grad, time.perf_counter() - t0

    if timed:  # a warm-up call of rank 0, its gradients dropped
        run_rank(0, 0)
        for x in (k_all, v_all, sink):
            if x is not None:
                x.grad = None
    seconds = 0.0
    for member in range(ring):
        for j in range(inner):
            qh = slice(j * hq, (j + 1) * hq)
            out, lse, dq, took = run_rank(member, j)
            if member == j == 0:
                seconds = took
            full["out"][place[member], :, qh] = out.detach().double().cpu()
            full["lse"][place[member], :, qh] = lse.permute(2, 0, 1).double().cpu()
            full["dq"][place[member], :, qh] = dq.double().cpu()
    inverse = torch.empty_like(placed)
    inverse[placed] = torch.arange(seq_len)
    for name, x in (("dk", k_all), ("dv", v_all)):
        grad = x.grad.double().cpu()[inverse]
        full[name] = grad.view(*grad.shape[:2], kv_heads, kv_repeat, grad.shape[-1]).sum(3)
    if sink is not None:
        full["dsink"] = sink.grad.double().cpu()
    full["blocks"] = blocks_per_row(schedule)
    full["seconds"] = seconds
    return full
