#!/usr/bin/env python
"""Measure what the planner's machine profile needs: the fused op's rate by block shape, and where one
rank's step spends its GPU time.

1. ``rates``: the kernel ``auto`` picks (cuDNN on Hopper), bf16, on causal squares and full blocks of the
   shapes ring steps and gathered calls have, forward and forward+backward, TFLOP/s (causal pairs counted
   once). The planner interpolates these by a call's pairs (``plan/cost.py``).
2. ``occupancy``: the calls of the short picks at 4 to 32 heads, also with the host ahead (their GPU time):
   a call of few heads and rows leaves SMs idle, which the planner models (``plan/cost.occupancy``) and
   ``tools/calibrate_profile.py`` checks against these.
3. ``profile``: one rank's fwd+bwd of each scheme under ``torch.profiler``: kernel launches and GPU time
   inside the attention ops and outside them (merges, accumulation, copies), and the host's wall time.
4. ``regions``: the merges and sums (``merge.FUSED_REGIONS``) on the operands of the ring step at 32K/P8
   (Llama-3-8B heads, token-major), each call's GPU time with the host ahead and GB/s of the bytes it must
   move (``tools/step_ops.FUSED``'s rule), and the host's time a call: compiled as shipped (torch's automatic
   dynamic shapes, ``Region.dynamic`` None: only the rows symbolic once they change; called directly), through
   dynamo, compiled per shape (``dynamic`` False), with every size symbolic (``dynamic`` True, shipped until
   2026-11-27), eagerly. On an H200 (run 5, ``docs/gpu/h200_run5_regions.log``) every size symbolic ran the
   merges at a fifth to half of the memory bandwidth, only the rows symbolic at 0.8-1.0 of the per-shape
   kernels: the shipped form since.
5. ``varlen``: a packed batch's ring steps (rank 0 of ``--cp``, ``--varlen-documents`` documents at seeded random
   offsets in 32K rows, balanced layout: one task per document piece, ``tools/step_ops.py --documents``), fwd+bwd
   cold and with the host ahead, three ways: one call per task as shipped (the ``auto`` kernel), one flash call
   per task, and a step's pieces in one variable-length flash call per mask kind (``aten._flash_attention_forward``
   with ``cum_seq_q/k``: full pieces in one, causal squares in another; rows gathered along the tokens, as an
   executor would), with its largest difference from the shipped calls' outputs. What decides whether a packed
   step should run its pieces in variable-length calls (``docs/performance.md``, "A packed batch's calls"); not
   yet run on a GPU (rehearsed on fake CUDA tensors by ``tests/test_cuda_rehearsal.py``).
6. ``window``: one rank's own sliding window (``WINDOW_ROWS`` query rows, each seeing the ``w`` keys before it and
   itself, for each ``w`` of ``WINDOWS``), fwd+bwd cold and with the host ahead, two ways: as shipped (the
   schedule's causal and anticausal runs through the ``auto`` kernel in the executor, the anticausal ones on
   their rows flipped: ``tools/step_ops.py --window`` counts the copies) and one flash call with the window
   native (``window_size_left``/``right`` of ``aten._flash_attention_forward``), with the largest difference of
   its out, dq, dk and dv from the shipped step's. What decides whether a window's lower edge should be flash's
   own (no flips, no ``schedule.RUN_ROWS`` cap on a run); not yet run on a GPU (rehearsed on fake CUDA tensors
   by ``tests/test_cuda_rehearsal.py``).

Writes one JSON line per result to ``--out`` (flushed as measured). Needs CUDA.

    python tools/kernel_rates.py --out runs/rates.jsonl
    python tools/kernel_rates.py --parts regions --out runs/regions.jsonl
    python tools/kernel_rates.py --parts varlen --out runs/varlen.jsonl
    python tools/kernel_rates.py --parts window --out runs/window.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mcp_context.kernels import get_kernel  # noqa: E402
from mcp_context.masks import CAUSAL, CAUSAL_BLOCK, FULL_BLOCK  # noqa: E402
from tools.bench_device import _interleaved_seconds, _queued_seconds, append_jsonl  # noqa: E402

SQUARES = (1024, 2048, 4096, 8192, 16384, 32768)
FULL = ((1024, 1024), (2048, 2048), (2048, 4096), (4096, 2048), (4096, 4096), (2048, 14336), (2048, 30720),
        (8192, 8192), (8192, 57344), (16384, 16384), (8192, 122880))
ATTENTION = ("cudnn", "flash", "fmha", "sdpa", "attention")


OCCUPANCY_HEADS = (4, 8, 16, 32)
OCCUPANCY_SHAPES = ((2048, 30720, FULL_BLOCK), (2048, 2048, CAUSAL_BLOCK), (4096, 4096, CAUSAL_BLOCK))
"""The calls of the short picks (Llama-3-8B at 32K over 64 ranks: a zigzag chunk of 2048 query rows against the
keys before it, its causal square; cp8 a2a's 4096-row square), at fewer heads than the tables' 32."""


def _cuda_randn(*size: int) -> torch.Tensor:
    return torch.randn(*size, device="cuda", dtype=torch.bfloat16)


def _timed_call(kernel, rand, rows: int, keys: int, mask, heads: int, kv_heads: int, d: int, reps: int,
                queued: bool = False) -> dict:
    """One fused call's fwd and fwd+bwd times on the GPU and TFLOP/s (causal pairs counted once), on inputs
    ``rand(*size)`` makes; ``queued``: also its GPU time with the host ahead (``bench_device._queued_seconds``),
    what the call costs inside a busy step."""
    dev = torch.device("cuda")
    q, do = (rand(1, heads, rows, d) for _ in range(2))
    k, v = (rand(1, kv_heads, keys, d) for _ in range(2))
    pairs = rows * (rows + 1) // 2 if mask.kind == "causal" else rows * keys
    flops = 4 * heads * d * pairs

    def fwd():
        return kernel.forward(q, k, v, mask, d ** -0.5)

    def fwd_bwd():
        out, lse = fwd()
        kernel.backward(do, q, k, v, out, lse, mask, d ** -0.5)

    t = _interleaved_seconds({"fwd": fwd, "fwd_bwd": fwd_bwd}, dev, reps)
    row = {"kernel": kernel.name, "rows": rows, "keys": keys, "mask": mask.kind, "heads": heads,
           "kv_heads": kv_heads, "head_dim": d, "pairs": pairs, "fwd_s": t["fwd"], "fwd_bwd_s": t["fwd_bwd"],
           "fwd_tflops": flops / statistics.median(t["fwd"]) / 1e12,
           "fwd_bwd_tflops": 3.5 * flops / statistics.median(t["fwd_bwd"]) / 1e12}
    if queued:
        held = _queued_seconds({"fwd": fwd, "fwd_bwd": fwd_bwd}, dev, reps, statistics.median(t["fwd_bwd"]))
        row.update({f"queued_{name}_s": [gpu for gpu, _, _ in runs] for name, runs in held.items()})
        row["host_ahead"] = all(ahead for runs in held.values() for _, _, ahead in runs)
    return row


def _rates(sink, kernel, heads: int, kv_heads: int, d: int, reps: int) -> None:
    for rows, keys, mask in [(n, n, CAUSAL_BLOCK) for n in SQUARES] + [(n, m, FULL_BLOCK) for n, m in FULL]:
        row = {"part": "rate", **_timed_call(kernel, _cuda_randn, rows, keys, mask, heads, kv_heads, d, reps)}
        sink(row)
        print(f"  {mask.kind:6} {rows:>6} x {keys:<6} fwd {row['fwd_tflops']:5.0f}  fwd+bwd {row['fwd_bwd_tflops']:5.0f}"
              f" TFLOP/s", flush=True)


def time_occupancy(sink, kernel, heads: int, kv_heads: int, d: int, reps: int, rand=_cuda_randn,
                   shapes=OCCUPANCY_SHAPES, head_counts=OCCUPANCY_HEADS) -> None:
    """The calls of ``shapes`` at each of ``head_counts`` (KV heads in the model's ``heads / kv_heads`` ratio),
    also with the host ahead: what ``tools/calibrate_profile.py`` checks the planner's occupancy model
    against."""
    for rows, keys, mask in shapes:
        for h in head_counts:
            row = {"part": "occupancy", **_timed_call(kernel, rand, rows, keys, mask, h,
                                                      max(1, h * kv_heads // heads), d, reps, queued=True)}
            sink(row)
            print(f"  {mask.kind:6} {rows:>6} x {keys:<6} {h:>2} heads: fwd {row['fwd_tflops']:5.0f}  fwd+bwd "
                  f"{row['fwd_bwd_tflops']:5.0f} TFLOP/s cold", flush=True)


def _profile(sink, kernel, seq_len: int, cp: int, heads: int, kv_heads: int, d: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    from tools.rank_step import SCHEMES, harness, rank_step, walked_call

    for comm in SCHEMES:
        step = rank_step(comm, cp, seq_len, CAUSAL, kernel, heads, kv_heads, d)
        run = walked_call(step, _cuda_randn, d)
        for _ in range(3):  # compile and cuDNN graph builds happen here
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        inside = [e for e in kernels if any(a in e.name.lower() for a in ATTENTION)]
        outside = [e for e in kernels if e not in inside]
        names: dict[str, list] = {}
        for e in outside:
            names.setdefault(e.name[:80], []).append(e.device_time)
        row = {"part": "profile", "harness": harness(), "comm": comm, "seq_len": seq_len, "cp": cp, "calls": step.calls,
               "wall_ms": start.elapsed_time(end), "kernels": len(kernels), "attention_kernels": len(inside),
               "other_kernels": len(outside), "attention_us": sum(e.device_time for e in inside),
               "other_us": sum(e.device_time for e in outside),
               "other_by_name": {n: [len(v), sum(v)] for n, v in sorted(names.items(), key=lambda x: -sum(x[1]))}}
        sink(row)
        print(f"  {comm:15} {seq_len // 1024}K/P{cp}: wall {row['wall_ms']:.2f} ms, {len(kernels)} kernels "
              f"({len(inside)} attention {row['attention_us'] / 1e3:.2f} ms, {len(outside)} other "
              f"{row['other_us'] / 1e3:.2f} ms)", flush=True)


REGION_CALLS = 20
"""Calls of a region timed together (one call takes the GPU some tens of µs, under what one timing resolves)."""


def region_cases(heads: int, kv_heads: int, d: int, rows: int, shard: int, device, dtype=torch.bfloat16) -> list:
    """``(case, merge function, operands)``: the ring step's region calls (a zigzag member at 32K/P8 holds 2048-row
    halves and 4096-row shards), token-major like the executor's accumulators and the fused op's outputs."""
    acc = torch.float32

    def block(h: int, n: int, dims: int, kind=dtype) -> torch.Tensor:
        return torch.randn(n, 1, h, dims, device=device).to(kind).permute(1, 2, 0, 3)

    def lse(h: int, n: int) -> torch.Tensor:
        return torch.randn(1, h, n, device=device)

    def blocks(n: int) -> list:
        return [x for _ in range(n) for x in (block(heads, rows, d), lse(heads, rows))]

    out, out_lse = block(heads, rows, d, acc), lse(heads, rows)
    return [  # a zigzag member over 8 ranks: out merged 5 blocks at a time (results.OUT_ARITY), dQ 3 (DQ_ARITY)
        ("merge of five blocks into the sum", "merge_blocks_", (out, out_lse, *blocks(5))),
        ("last merge: the sum and three blocks", "merge_blocks_", (block(heads, rows, d), out_lse, out, out_lse,
                                                                  *blocks(3))),
        ("dQ sum of three blocks", "add_blocks_", (out, *blocks(3)[0::2])),
        ("dQ sum: the sum and two blocks", "add_blocks_", (out, out, *blocks(2)[0::2])),
        ("last dQ sum into the result", "add_blocks_", (block(heads, rows, d), out, block(heads, rows, d))),
        ("dK/dV add", "add_kv_", (block(kv_heads, shard, 2 * d, acc), block(kv_heads, shard, d),
                                  block(kv_heads, shard, d))),
        ("dK/dV first write", "copy_kv_", (block(kv_heads, shard, 2 * d, acc), block(kv_heads, shard, d),
                                           block(kv_heads, shard, d))),
    ]


def region_variants(region) -> dict:
    """``name -> (callable like the region, context)``: as shipped (torch's automatic dynamic shapes: static
    until a size changes, then only that size symbolic; ``time_regions`` first calls it at half the rows, as a
    ring's half and whole shards do), through dynamo, compiled per shape, with every size symbolic, eager."""
    import contextlib

    from mcp_context.regions import Region, through_dynamo

    def compiled(dynamic, what: str) -> Region:
        r = Region(region.eager, f"{region.what}, {what}")
        r.dynamic = dynamic
        return r
    return {"shipped": (region, contextlib.nullcontext), "through_dynamo": (region, through_dynamo),
            "per_shape": (compiled(False, "per shape"), contextlib.nullcontext),
            "every_size_symbolic": (compiled(True, "every size symbolic"), contextlib.nullcontext),
            "eager": (region.eager, contextlib.nullcontext)}


def time_regions(sink, heads: int, kv_heads: int, d: int, reps: int, rows: int = 2048, shard: int = 4096,
                 device=None, variants=None, host_ahead=None) -> None:
    """Each region case in each variant (``region_variants``; ``variants``: a subset), ``REGION_CALLS`` calls
    timed together: cold, and (``host_ahead``, default on CUDA) GPU µs a call with the host ahead, GB/s, host
    µs a call."""
    from mcp_context import merge
    from tools.step_ops import FUSED, _nbytes, region_attr

    device = torch.device("cuda") if device is None else device
    shorter = region_cases(heads, kv_heads, d, rows // 2, shard // 2, device)
    for (case, name, args), (_, _, short_args) in zip(region_cases(heads, kv_heads, d, rows, shard, device), shorter):
        _, write_only = FUSED[name]
        moved = sum(map(_nbytes, args)) + (0 if write_only else _nbytes(args[0]))
        for variant, (fn, context) in region_variants(getattr(merge, region_attr(name))).items():
            if variants is not None and variant not in variants:
                continue
            if variant in ("shipped", "through_dynamo"):  # the rows change once, as a ring's half and whole shards do
                fn(*short_args)

            def calls(fn=fn, context=context) -> None:
                with context():
                    for _ in range(REGION_CALLS):
                        fn(*args)
            cold = _interleaved_seconds({"calls": calls}, device, reps)["calls"]
            row = {"part": "region", "case": case, "region": name, "variant": variant, "bytes": moved,
                   "cold_us": statistics.median(cold) / REGION_CALLS * 1e6}
            if device.type == "cuda" if host_ahead is None else host_ahead:
                queued = _queued_seconds({"calls": calls}, device, reps, statistics.median(cold))["calls"]
                gpu = statistics.median(g for g, _, _ in queued) / REGION_CALLS
                row.update(gpu_us=gpu * 1e6, gb_per_s=moved / gpu / 1e9, host_ahead=all(ok for _, _, ok in queued),
                           host_us=statistics.median(h for _, h, _ in queued) / REGION_CALLS * 1e6)
            sink(row)
            shown = (f"GPU {row['gpu_us']:6.1f} µs ({row['gb_per_s']:5.0f} GB/s), host {row['host_us']:5.1f} µs"
                     if "gpu_us" in row else f"{row['cold_us']:.1f} µs")
            print(f"  {case:28} {variant:15} {shown}", flush=True)


VARLEN_SEQ = 32768
VARLEN_STEPS = (0, 1)
"""The packed steps ``varlen`` times: the member against itself (causal squares and full pieces) and the next
(full pieces only)."""


def varlen_groups(tasks) -> list[tuple[bool, tuple[int, ...]]]:
    """``(causal, task indices)`` per variable-length call of a step: full pieces in one, causal squares in another
    (a kind with no task has no call); ValueError for a task of another mask (a window's bands, anticausal runs)."""
    full = tuple(i for i, t in enumerate(tasks) if t.mask == FULL_BLOCK)
    causal = tuple(i for i, t in enumerate(tasks) if t.mask == CAUSAL_BLOCK)
    if len(full) + len(causal) != len(tasks):
        other = next(t for t in tasks if t.mask not in (FULL_BLOCK, CAUSAL_BLOCK))
        raise ValueError(f"a variable-length call takes full pieces and causal squares, not a {other.mask.kind} mask")
    return [(kind, group) for kind, group in ((False, full), (True, causal)) if group]


def gathered(x: torch.Tensor, ranges) -> torch.Tensor:
    """Rows ``ranges`` of token-major ``x [s, h, d]`` stacked along the tokens: ``[sum of lengths, h, d]``."""
    return torch.cat([x.narrow(0, a, b - a) for a, b in ranges])


def offsets(ranges, device) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` (int32, on ``device``) of ``ranges`` stacked in order, and the longest range."""
    cu = [0]
    for a, b in ranges:
        cu.append(cu[-1] + b - a)
    return torch.tensor(cu, dtype=torch.int32, device=device), max(b - a for a, b in ranges)


def varlen_call(tasks, group: tuple[int, ...], causal: bool, q, k, v, dout, scale: float) -> Callable:
    """fwd+bwd of ``tasks[group]`` in one variable-length flash call over token-major ``q, k, v, dout [s, h, d]``
    (the gathers included); returns the forward's ``out`` per task, for the comparison."""
    q_ranges, kv_ranges = [tasks[i].q for i in group], [tasks[i].kv for i in group]
    cu_q, max_q = offsets(q_ranges, q.device)
    cu_k, max_k = offsets(kv_ranges, q.device)

    def run() -> list[torch.Tensor]:
        qs, dos = gathered(q, q_ranges), gathered(dout, q_ranges)
        ks, vs = gathered(k, kv_ranges), gathered(v, kv_ranges)
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(qs, ks, vs, cu_q, cu_k, max_q, max_k, 0.0,
                                                                          causal, False, scale=scale)
        torch.ops.aten._flash_attention_backward(dos, qs, ks, vs, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                 rng, unused, scale=scale)
        return list(out.split([b - a for a, b in q_ranges]))
    return run


def per_task_call(kernel, tasks, q, k, v, dout, scale: float) -> Callable:
    """fwd+bwd of every task in its own call of ``kernel`` on ``[1, h, n, d]`` views of token-major rows; returns
    each task's ``out`` token-major ``[n, h, d]``."""
    def view(x, a, b):
        return x.narrow(0, a, b - a).transpose(0, 1).unsqueeze(0)

    def run() -> list[torch.Tensor]:
        outs = []
        for t in tasks:
            qs, ks, vs, dos = view(q, *t.q), view(k, *t.kv), view(v, *t.kv), view(dout, *t.q)
            out, lse = kernel.forward(qs, ks, vs, t.mask, scale)
            kernel.backward(dos, qs, ks, vs, out, lse, t.mask, scale)
            outs.append(out.squeeze(0).transpose(0, 1))
        return outs
    return run


def packed_step_calls(tasks, shipped, flash, q, k, v, dout, scale: float) -> dict[str, Callable]:
    """The three ways ``varlen`` times one step's ``tasks``: ``per_task`` (``shipped``, the ``auto`` kernel),
    ``per_task_flash`` and ``varlen_flash`` (``varlen_groups``), each a fwd+bwd returning its outputs."""
    calls = [varlen_call(tasks, group, causal, q, k, v, dout, scale) for causal, group in varlen_groups(tasks)]
    order = [i for _, group in varlen_groups(tasks) for i in group]

    def varlen() -> list[torch.Tensor]:
        outs = [o for call in calls for o in call()]
        return [outs[order.index(i)] for i in range(len(tasks))]
    return {"per_task": per_task_call(shipped, tasks, q, k, v, dout, scale),
            "per_task_flash": per_task_call(flash, tasks, q, k, v, dout, scale), "varlen_flash": varlen}


def time_varlen(sink, kernel, heads: int, kv_heads: int, d: int, reps: int, cp: int, documents: int) -> None:
    """Each of ``VARLEN_STEPS`` of rank 0's packed ring (``documents`` in ``VARLEN_SEQ`` rows over ``cp`` ranks),
    its tasks the three ways of ``packed_step_calls``: cold and with the host ahead, and the largest difference of
    each way's outputs from the shipped calls'."""
    from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel
    from mcp_context.schedule import layout_schedule
    from tools.step_ops import random_documents

    dev = torch.device("cuda")
    schedule = layout_schedule("balanced", cp, VARLEN_SEQ, random_documents(VARLEN_SEQ, documents),
                               kernel_masks=frozenset({"full", "causal"}))
    rows = VARLEN_SEQ // cp
    q, dout = (_cuda_randn(rows, heads, d) for _ in range(2))
    k, v = (_cuda_randn(rows, kv_heads, d) for _ in range(2))
    for step in VARLEN_STEPS:
        tasks = schedule.member_tasks(0)[step]
        calls = packed_step_calls(tasks, kernel, TorchKernel(FUSED_OPS["flash"]), q, k, v, dout, d ** -0.5)
        shipped = calls["per_task"]()
        diff = {name: max(float((a.float() - b.float()).abs().max()) for a, b in zip(fn(), shipped))
                for name, fn in calls.items()}
        cold = _interleaved_seconds(calls, dev, reps)
        held = _queued_seconds(calls, dev, reps, max(statistics.median(t) for t in cold.values()))
        for name in calls:
            row = {"part": "varlen", "cp": cp, "documents": documents, "step": step, "tasks": len(tasks),
                   "way": name, "calls": len(varlen_groups(tasks)) if name == "varlen_flash" else len(tasks),
                   "cold_ms": statistics.median(cold[name]) * 1e3,
                   "host_ahead_ms": statistics.median(g for g, _, _ in held[name]) * 1e3,
                   "host_issue_ms": statistics.median(h for _, h, _ in held[name]) * 1e3,
                   "host_ahead": all(ok for _, _, ok in held[name]), "max_diff_from_per_task": diff[name]}
            sink(row)
            print(f"  step {step} ({len(tasks)} tasks) {name:15} {row['calls']:>3} calls: cold "
                  f"{row['cold_ms']:.2f} ms, host ahead {row['host_ahead_ms']:.2f} ms, host issue "
                  f"{row['host_issue_ms']:.2f} ms; max diff {row['max_diff_from_per_task']:.2e}", flush=True)


WINDOW_ROWS = 16384
WINDOWS = (127, 4095)
"""The ``window`` part's rows (a 128K sequence's contiguous shard over 8 ranks) and windows (gpt-oss's 128
keys, Mistral's 4096, less the query's own key)."""


def window_calls(kernel, window: int, q, k, v, dout, scale: float) -> dict[str, Callable]:
    """The two ways ``window`` times a causal sliding window of ``window`` keys before each row over token-major
    ``q, k, v, dout [s, h, d]``, each a fwd+bwd without autograd returning ``(out, dq, dk, dv)`` token-major:
    ``shipped`` (the schedule's tasks for ``kernel`` through the executor's forward and backward, one member) and
    ``flash_window`` (one flash call each way)."""
    from mcp_context.algorithms.executor import RingPlan, ring_backward, ring_forward
    from mcp_context.algorithms.rotation import LocalRotation
    from mcp_context.masks import SlidingWindow
    from mcp_context.schedule import layout_schedule

    rows = q.shape[0]
    tasks = layout_schedule("contiguous", 1, rows, SlidingWindow(window, 0),
                            kernel_masks=kernel.capabilities.masks).member_tasks(0)
    plan = RingPlan.build(tasks, LocalRotation(0, 1), kernel, scale, rows)
    sbhd = [x.unsqueeze(1) for x in (q, k, v, dout)]  # [s, 1, h, d]: the executor's storage

    def shipped() -> tuple[torch.Tensor, ...]:
        q1, k1, v1, dout1 = sbhd
        out, lse = ring_forward(q1, k1, v1, plan)
        dq, dk, dv = ring_backward(dout1, q1, k1, v1, out, lse, plan)[:3]
        return tuple(x.squeeze(1) for x in (out, dq, dk, dv))

    cu, _ = offsets([(0, rows)], q.device)

    def flash_window() -> tuple[torch.Tensor, ...]:
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, rows, rows, 0.0, False, False, scale=scale, window_size_left=window, window_size_right=0)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu, cu, rows, rows, 0.0, False, rng, unused, scale=scale,
            window_size_left=window, window_size_right=0)
        return out, dq, dk, dv
    return {"shipped": shipped, "flash_window": flash_window}


def time_window(sink, kernel, heads: int, kv_heads: int, d: int, reps: int) -> None:
    """For each of ``WINDOWS``: ``window_calls``' two ways cold and with the host ahead, and the largest difference
    of each one's out, dq, dk and dv from the shipped step's."""
    dev = torch.device("cuda")
    q, dout = (_cuda_randn(WINDOW_ROWS, heads, d) for _ in range(2))
    k, v = (_cuda_randn(WINDOW_ROWS, kv_heads, d) for _ in range(2))
    for window in WINDOWS:
        calls = window_calls(kernel, window, q, k, v, dout, d ** -0.5)
        shipped = calls["shipped"]()
        diff = {name: [float((a.float() - b.float()).abs().max()) for a, b in zip(fn(), shipped)]
                for name, fn in calls.items()}
        cold = _interleaved_seconds(calls, dev, reps)
        held = _queued_seconds(calls, dev, reps, max(statistics.median(t) for t in cold.values()))
        for name in calls:
            row = {"part": "window", "rows": WINDOW_ROWS, "window": window, "heads": heads, "kv_heads": kv_heads,
                   "way": name, "cold_ms": statistics.median(cold[name]) * 1e3,
                   "host_ahead_ms": statistics.median(g for g, _, _ in held[name]) * 1e3,
                   "host_issue_ms": statistics.median(h for _, h, _ in held[name]) * 1e3,
                   "host_ahead": all(ok for _, _, ok in held[name]),
                   "max_diff_from_shipped": dict(zip(("out", "dq", "dk", "dv"), diff[name]))}
            sink(row)
            print(f"  window {window} {name:13}: cold {row['cold_ms']:.2f} ms, host ahead {row['host_ahead_ms']:.2f} "
                  f"ms, host issue {row['host_issue_ms']:.2f} ms; max diff out/dq/dk/dv "
                  + "/".join(f"{x:.1e}" for x in diff[name]), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON lines file")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile-seq-lens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--parts", nargs="+", default=["rates", "occupancy", "profile"],
                    choices=["rates", "occupancy", "profile", "regions", "varlen", "window"])
    ap.add_argument("--varlen-documents", type=int, default=50,
                    help="documents of the packed sequence the varlen part times (default 50)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    sink = append_jsonl(args.out)
    sink({"part": "machine", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
          "cudnn": torch.backends.cudnn.version()})
    kernel = get_kernel("auto", torch.device("cuda"), torch.bfloat16, head_dim=args.head_dim)
    if "rates" in args.parts:
        _rates(sink, kernel, args.heads, args.kv_heads, args.head_dim, args.reps)
    if "occupancy" in args.parts:
        time_occupancy(sink, kernel, args.heads, args.kv_heads, args.head_dim, args.reps)
    if "profile" in args.parts:
        for s in args.profile_seq_lens:
            _profile(sink, kernel, s, args.cp, args.heads, args.kv_heads, args.head_dim)
    if "regions" in args.parts:
        time_regions(sink, args.heads, args.kv_heads, args.head_dim, args.reps)
    if "varlen" in args.parts:
        time_varlen(sink, kernel, args.heads, args.kv_heads, args.head_dim, args.reps, args.cp, args.varlen_documents)
    if "window" in args.parts:
        time_window(sink, kernel, args.heads, args.kv_heads, args.head_dim, args.reps)
    print(json.dumps({"wrote": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
