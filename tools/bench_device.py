"""Device part of ``tools/bench_attention.py``: block kernels side by side, and one rank's zigzag schedule
on one device (the other ranks' K/V laid out locally) against one fused SDPA call of equal useful FLOPs.

CUDA events and ``torch.cuda.max_memory_allocated`` on a GPU; ``perf_counter`` (and no peak memory) on
the CPU, where it is a smoke run of the path, not a figure.
"""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

from tools.bench_cpu import Shape


def _once(fn, device: torch.device) -> float:
    """Seconds of one call of ``fn`` (CUDA events on a GPU)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def _interleaved_seconds(fns: dict, device: torch.device, reps: int) -> dict[str, list[float]]:
    """Times of every function in ``fns``, one call of each per repetition, after one warm-up each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_once(fn, device))
    return times


def _peak_bytes(fn, device: torch.device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) - base


def _device_kernels(device: torch.device, dtype: torch.dtype, head_dim: int) -> dict:
    """Every block kernel the registry knows: name -> kernel, or the probe's reason it does not serve."""
    from mcp_context.kernels import BACKENDS, probe

    named = [b for b in BACKENDS if b not in ("auto", "torch")]
    return {name: v.kernel if (v := probe(name, device, dtype, head_dim=head_dim)).kernel is not None else v.reason
            for name in named}


def _kernel_block(kernel, q, k, v, dout, backward: bool):
    out, lse = kernel.forward(q, k, v, True, q.shape[-1] ** -0.5)
    if backward:
        kernel.backward(dout, q, k, v, out, lse, True, q.shape[-1] ** -0.5)


def device_benchmarks(device: torch.device, shape: Shape, world_sizes, reps: int) -> dict:
    """Kernel backends side by side, and one rank's schedule vs one fused SDPA of equal useful FLOPs."""
    from mcp_context.algorithms.executor import RingAttention, RingPlan
    from mcp_context.algorithms.rotation import LocalRotation
    from mcp_context.kernels import get_kernel
    from mcp_context.schedule import layout_schedule

    print(f"  S={shape.seq_len}", flush=True)

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, hk, d = shape.batch, shape.heads, shape.kv_heads, shape.head_dim
    n = shape.seq_len // max(world_sizes)
    gen = torch.Generator().manual_seed(2)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device, dtype)

    q, k, v, dout = rand(b, h, n, d), rand(b, hk, n, d), rand(b, hk, n, d), rand(b, h, n, d)
    causal_flops = 4 * b * h * d * n * (n + 1) // 2
    verdicts = _device_kernels(device, dtype, d)
    available = {name: kern for name, kern in verdicts.items() if not isinstance(kern, str)}
    calls = {f"{name} {label}": (lambda kern=kern, backward=backward: _kernel_block(kern, q, k, v, dout, backward))
             for name, kern in available.items() for label, backward in (("fwd", False), ("fwd_bwd", True))}
    times = _interleaved_seconds(calls, device, reps)
    kernels = []
    for name, kern in verdicts.items():
        if isinstance(kern, str):
            kernels.append({"kernel": name, "unavailable": kern})
            continue
        row = {"kernel": name}
        for label, flops in (("fwd", causal_flops), ("fwd_bwd", causal_flops * 3.5)):
            row[f"{label}_s"] = times[f"{name} {label}"]
            row[f"{label}_tflops"] = flops / statistics.median(row[f"{label}_s"]) / 1e12
            row[f"{label}_peak_bytes"] = _peak_bytes(calls[f"{name} {label}"], device)
        kernels.append(row)

    kernel = get_kernel("auto", device, dtype, head_dim=d)
    schedules = []
    for world in world_sizes:
        sched = layout_schedule("zigzag", world, shape.seq_len, True)
        s_local = shape.seq_len // world
        pairs = sched.useful_pairs()[0]
        ql = rand(s_local, b, h, d).requires_grad_()
        kl, vl = (rand(shape.seq_len, b, hk, d).requires_grad_() for _ in range(2))  # every member's K/V, here
        do = rand(s_local, b, h, d)
        plan = RingPlan.build(sched.tasks[0], LocalRotation(0, world), kernel, d ** -0.5, s_local)
        s_eq = round((math.sqrt(8 * pairs + 1) - 1) / 2)  # causal s_eq*(s_eq+1)/2 == useful pairs
        qe, ke, ve, doe = rand(b, h, s_eq, d).requires_grad_(), rand(b, hk, s_eq, d).requires_grad_(), \
            rand(b, hk, s_eq, d).requires_grad_(), rand(b, h, s_eq, d)

        def rank_step(backward):
            out, _ = RingAttention.apply(ql, kl, vl, plan)
            if backward:
                out.backward(do)

        def fused(backward):
            out = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, enable_gqa=h != hk)
            if backward:
                out.backward(doe)

        row = {"world_size": world, "rank": 0, "useful_pairs": pairs, "equal_flops_causal_len": s_eq,
               "kernel": kernel.name}
        for label, backward, factor in (("fwd", False, 1.0), ("fwd_bwd", True, 3.5)):
            flops = 4 * b * h * d * pairs * factor
            fused_flops = 4 * b * h * d * s_eq * (s_eq + 1) // 2 * factor
            pair = {"ours": lambda backward=backward: rank_step(backward),
                    "fused": lambda backward=backward: fused(backward)}
            t = _interleaved_seconds(pair, device, reps)
            row[label] = {"ours_s": t["ours"], "fused_s": t["fused"],
                          "ours_tflops": flops / statistics.median(t["ours"]) / 1e12,
                          "fused_tflops": fused_flops / statistics.median(t["fused"]) / 1e12,
                          "efficiency": statistics.median(flops / a / (fused_flops / f)
                                                          for a, f in zip(t["ours"], t["fused"])),
                          "ours_peak_bytes": _peak_bytes(pair["ours"], device),
                          "fused_peak_bytes": _peak_bytes(pair["fused"], device)}
            if row[label]["fused_peak_bytes"]:
                row[label]["memory_ratio"] = row[label]["ours_peak_bytes"] / row[label]["fused_peak_bytes"]
            print(f"  P={world} {label}: {row[label]['ours_tflops']:.3g} vs fused {row[label]['fused_tflops']:.3g} "
                  f"TFLOP/s, efficiency {row[label]['efficiency']:.2f} ({kernel.name})", flush=True)
        schedules.append(row)
    return {"device": str(device), "dtype": str(dtype), "seq_len": shape.seq_len, "block_len": n, "kernels": kernels,
            "rank_schedule": schedules}
