#!/usr/bin/env python
"""Benchmark context-parallel attention: ratios against full attention, overlap timeline, kernels.

CPU, always (gloo, fp32): for each world size P, P processes with one thread each run
``context_parallel_attention`` forward and forward+backward for every ``cp_comm_type`` and layout,
interleaved repetition by repetition with a single-process full attention over the same tokens
(``F.scaled_dot_product_attention``, the same fused CPU kernel) run by rank 0 with P threads while
the other ranks wait: the same tokens on the same cores. Reported: median ratio ours / full, and
the figures that do not depend on the machine (load balance, masked waste, bytes counted by the comm
layer). For ``p2p`` zigzag it records the per-step timeline (compute vs time blocked on the next
shard) and times the same transfer alone, which shows whether the transfer overlapped the compute.

Device, when CUDA is available (or on CPU with ``--device-bench cpu`` as a smoke run): kernel
backends side by side on one causal block (math, torch flash / cuDNN / efficient, TE when
importable), and one rank's zigzag schedule run on one device (the other ranks' K/V simulated
locally) against one fused SDPA call of equal useful FLOPs: TFLOP/s (causal FLOPs counted once),
their ratio, and peak memory.

Writes ``bench_attention_p<P...>.json`` (machine, versions, shapes, every repetition) and PNG plots to
``--out``. Timings on a shared CPU are noisy: only the ratios measured in one run mean anything.

    python tools/bench_attention.py --out docs/img            # CPU, P = 2 and 4
    python tools/bench_attention.py --device-bench cuda --out results   # on a GPU machine
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, astuple, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

COMMS = ("p2p", "a2a", "all_gather", "a2a+p2p")
LAYOUTS = ("zigzag", "contiguous", "striped")


@dataclass(frozen=True)
class Shape:
    seq_len: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int


# ----------------------------------------------------------------------------------------------- CPU


def overlap_summary(timeline: dict) -> list[dict]:
    """Per rank, medians over the recorded runs: forward/backward compute, time blocked on K/V and
    dK/dV, and the share of the forward transfers' own time hidden behind compute
    (1 - blocked / (transfers x one transfer alone))."""
    per_run = [_run_summary(run, timeline["transfer_alone_s"]) for run in timeline["runs"]]
    counts = ("rank", "forward_transfers")  # the same in every run
    return [{**{key: per_run[0][rank][key] for key in counts},
             **{key: statistics.median(run[rank][key] for run in per_run) for key in per_run[0][rank]
                if key not in counts}} for rank in range(len(per_run[0]))]


def _run_summary(events_per_rank: list, transfer_alone_s: list) -> list[dict]:
    alone = statistics.median(transfer_alone_s)
    out = []
    for rank, events in enumerate(events_per_rank):
        total = {kind: sum(e["t1"] - e["t0"] for e in events if e["kind"] == kind)
                 for kind in ("forward_compute", "backward_compute", "kv_wait", "dkv_wait")}
        kv_waits = [e for e in events if e["kind"] == "kv_wait"]
        forward_end = max(e["t1"] for e in events if e["kind"] == "forward_compute")
        fwd_wait = sum(e["t1"] - e["t0"] for e in kv_waits if e["t1"] <= forward_end)
        fwd_transfers = sum(1 for e in kv_waits if e["t1"] <= forward_end)
        out.append({"rank": rank, **{f"{k}_s": v for k, v in total.items()}, "transfer_alone_s": alone,
                    "forward_kv_wait_s": fwd_wait, "forward_transfers": fwd_transfers,
                    "forward_hidden_fraction": 1 - fwd_wait / (fwd_transfers * alone) if fwd_transfers else 0.0})
    return out



def _configs(world: int, comms, layouts) -> list[tuple[str, tuple[int, ...], str]]:
    out = []
    for comm in comms:
        if comm == "a2a+p2p" and world < 4:
            continue  # a hierarchy needs two levels of at least 2
        sizes = (2, world // 2) if comm == "a2a+p2p" else (world,)
        out += [(comm, sizes, layout) for layout in layouts]
    return out


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 2, 0, 3)


def _full_attention(q, k, v, dout, backward: bool) -> float:
    """Seconds for one single-process SDPA over the whole sequence (sbhd inputs)."""
    t0 = time.perf_counter()
    out = F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), is_causal=True,
                                         enable_gqa=q.shape[2] != k.shape[2])
    if backward:
        out.backward(_bhsd(dout))
    return time.perf_counter() - t0


def _timed(fn) -> float:
    """Seconds of ``fn`` on the slowest rank (barriers on both sides; read on any rank)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _bench_config(rank, world, groups, comm, layout, shape: Shape, reps: int) -> dict:
    """One configuration's interleaved repetitions; the figures (on rank 0; ``{}`` elsewhere)."""
    from mcp_context import ContextParallelAttention, comm_stats, context_parallel_attention, shard_sequence
    from mcp_context.cp_rules import a2a_degree
    from mcp_context.schedule import layout_schedule, load_balance, masked_waste

    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(shape.seq_len, shape.batch, h, shape.head_dim, generator=gen)
            for h in (shape.heads, shape.kv_heads, shape.kv_heads, shape.heads)]
    local = [shard_sequence(x, world, rank, layout) for x in full]
    leaves = [x.clone().requires_grad_() for x in local[:3]]
    full_leaves = [x.clone().requires_grad_() for x in full[:3]]

    def ours(backward: bool):
        out = context_parallel_attention(*leaves, groups, causal=True, layout=layout, comm=comm)
        if backward:
            out.backward(local[3])

    def baseline(backward: bool) -> float:
        """Rank 0 runs full attention with ``world`` threads; the others wait at the barrier."""
        dist.barrier()
        seconds = 0.0
        if rank == 0:
            torch.set_num_threads(world)
            seconds = _full_attention(*full_leaves, full[3], backward)
            torch.set_num_threads(1)
        dist.barrier()
        return seconds

    ours(True), baseline(True)  # warm-up
    comm_stats.reset()
    ours(False)
    bytes_fwd = dict(comm_stats.bytes_sent)
    comm_stats.reset()
    ours(True)
    bytes_fwd_bwd = dict(comm_stats.bytes_sent)
    engine = ContextParallelAttention(groups, causal=True, layout=layout, comm=comm, check_ranks=True)

    def rank_check() -> float:
        """The cross-rank agreement check alone (it is part of every ``ours`` call on gloo)."""
        t0 = time.perf_counter()
        engine.check_agreement(*leaves)
        return time.perf_counter() - t0

    reps_out = []
    for _ in range(reps):  # interleaved: ours and the baseline alternate within each repetition
        reps_out.append({"ours_fwd": _timed(lambda: ours(False)), "full_fwd": baseline(False),
                         "ours_fwd_bwd": _timed(lambda: ours(True)), "full_fwd_bwd": baseline(True),
                         "rank_check": rank_check()})
    if rank != 0:
        return {}  # the times above are the slowest rank's on every rank; the baseline ran on rank 0
    sched = layout_schedule(layout, world, shape.seq_len, True, a2a_degree(comm, groups.sizes))
    return {"comm": comm, "layout": layout, "world_size": world, "reps": reps_out,
            "ratio_fwd": statistics.median(r["ours_fwd"] / r["full_fwd"] for r in reps_out),
            "ratio_fwd_bwd": statistics.median(r["ours_fwd_bwd"] / r["full_fwd_bwd"] for r in reps_out),
            "rank_check_share_fwd": statistics.median(r["rank_check"] / r["ours_fwd"] for r in reps_out),
            "load_balance": load_balance(sched), "masked_waste_tile128": masked_waste(sched),
            "bytes_sent_fwd": bytes_fwd, "bytes_sent_fwd_bwd": bytes_fwd_bwd}


def _timeline(rank, world, groups, shape: Shape, reps: int) -> dict:
    """Per-step events of p2p zigzag forward+backward on every rank, and one ring transfer alone."""
    from mcp_context import context_parallel_attention, shard_sequence
    from mcp_context.trace import record_timeline
    from mcp_context.comm import RingExchange

    gen = torch.Generator().manual_seed(1)
    full = [torch.randn(shape.seq_len, shape.batch, h, shape.head_dim, generator=gen)
            for h in (shape.heads, shape.kv_heads, shape.kv_heads, shape.heads)]
    local = [shard_sequence(x, world, rank, "zigzag") for x in full]
    leaves = [x.clone().requires_grad_() for x in local[:3]]
    context_parallel_attention(*leaves, groups, layout="zigzag", comm="p2p").backward(local[3])  # warm-up
    runs = []
    for _ in range(reps):
        dist.barrier()
        with record_timeline() as tl:
            t_ref = time.perf_counter()
            context_parallel_attention(*leaves, groups, layout="zigzag", comm="p2p").backward(local[3])
        events = [{"kind": e.kind, "step": e.step, "t0": e.t0 - t_ref, "t1": e.t1 - t_ref} for e in tl.events]
        gathered = [None] * world
        dist.all_gather_object(gathered, events)
        runs.append(gathered)
    # the same K/V message sent around the ring with nothing to overlap: the transfer's own time
    kv = torch.stack([_bhsd(local[1]), _bhsd(local[2])]).contiguous()
    ring = RingExchange(list(range(world)), rank, dist.group.WORLD, "bench")
    alone = []
    for _ in range(reps):
        alone.append(_timed(lambda: ring.start(kv, 0).wait()))
    # plot the run of median length; keep all of them
    order = sorted(range(reps), key=lambda i: max(e["t1"] for events in runs[i] for e in events))
    return {"events_per_rank": runs[order[reps // 2]], "runs": runs, "transfer_alone_s": alone,
            "kv_message_bytes": kv.numel() * kv.element_size()}


def _thread_speedup(rank, world, shape: Shape, reps: int) -> dict:
    """Full attention forward+backward with 1 thread and with ``world`` threads on rank 0 (interleaved):
    how far the baseline's threads scale on this machine, which bounds the ratios from below."""
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(shape.seq_len, shape.batch, h, shape.head_dim, generator=gen)
            for h in (shape.heads, shape.kv_heads, shape.kv_heads, shape.heads)]
    leaves = [x.clone().requires_grad_() for x in full[:3]]
    times = {"1": [], str(world): []}
    for _ in range(reps if rank == 0 else 0):
        for threads in (1, world):
            torch.set_num_threads(threads)
            times[str(threads)].append(_full_attention(*leaves, full[3], True))
    torch.set_num_threads(1)
    dist.barrier()
    return {"fwd_bwd_s": times,
            "speedup": statistics.median(a / b for a, b in zip(times["1"], times[str(world)])) if rank == 0 else None}


def _cpu_worker(rank, world, init_file, out_file, shape, reps, comms, layouts):
    import warnings

    warnings.filterwarnings("ignore")
    from mcp_context import build_hcp_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    groups = {}
    results = []
    threads = _thread_speedup(rank, world, shape, reps)
    if rank == 0:
        print(f"  full attention fwd+bwd: {world} threads are {threads['speedup']:.2f}x faster than 1", flush=True)
    for comm, sizes, layout in _configs(world, comms, layouts):
        if sizes not in groups:
            groups[sizes] = build_hcp_groups(list(sizes))
        res = _bench_config(rank, world, groups[sizes], comm, layout, shape, reps)
        if res:
            print(f"  P={world} {comm:10s} {layout:10s} fwd {res['ratio_fwd']:.2f}x  "
                  f"fwd+bwd {res['ratio_fwd_bwd']:.2f}x  balance {res['load_balance']:.3f}  "
                  f"rank check {100 * res['rank_check_share_fwd']:.2f}% of fwd", flush=True)
        results.append(res)
    timeline = _timeline(rank, world, groups.get((world,)) or build_hcp_groups([world]), shape, reps)
    if rank == 0:
        timeline["summary"] = overlap_summary(timeline)
        for row in timeline["summary"]:
            print(f"  P={world} p2p zigzag rank {row['rank']}: "
                  f"forward compute {row['forward_compute_s'] * 1e3:.1f} ms, "
                  f"blocked on K/V {row['forward_kv_wait_s'] * 1e3:.1f} ms over {row['forward_transfers']} transfers "
                  f"of {row['transfer_alone_s'] * 1e3:.1f} ms each alone (medians of {reps} runs)", flush=True)
        with open(out_file, "w") as f:
            json.dump({"configs": results, "timeline": timeline, "baseline_threads": threads}, f)
    dist.barrier()
    dist.destroy_process_group()


def cpu_benchmarks(world_sizes, shape: Shape, reps: int, comms, layouts) -> dict:
    out = {}
    for world in world_sizes:
        with tempfile.TemporaryDirectory(prefix="mcp_bench_") as tmp:
            out_file = os.path.join(tmp, "result.json")
            print(f"CPU, world size {world}:", flush=True)
            mp.start_processes(_cpu_worker, args=(world, os.path.join(tmp, "init"), out_file, shape, reps, comms,
                                                  layouts), nprocs=world, start_method="spawn")
            with open(out_file) as f:
                out[str(world)] = json.load(f)
    return out


# -------------------------------------------------------------------------------------------- device


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


# --------------------------------------------------------------------------------------------- plots


def plot(results: dict, out_dir: str, suffix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    cpu = results.get("cpu", {})
    if cpu:
        width = max(len(res["configs"]) for res in cpu.values())
        fig, axes = plt.subplots(len(cpu), 1, figsize=(1.0 * width + 2, 4 * len(cpu)), squeeze=False)
        for ax, (world, res) in zip(axes[:, 0], cpu.items()):
            labels = [f"{c['comm']}\n{c['layout']}" for c in res["configs"]]
            x = range(len(labels))
            ax.bar([i - 0.2 for i in x], [c["ratio_fwd"] for c in res["configs"]], 0.4, label="forward")
            ax.bar([i + 0.2 for i in x], [c["ratio_fwd_bwd"] for c in res["configs"]], 0.4, label="forward+backward")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.axhline(1.3, color="r", lw=0.8, ls="--", label="1.3x")
            ax.set_xticks(list(x), labels, fontsize=7)
            ax.set_title(f"P={world}: time / single-process full attention (median)")
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"bench_cpu_ratio{suffix}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

        fig, axes = plt.subplots(len(cpu), 1, figsize=(11, 1.2 + 1.1 * sum(int(w) for w in cpu)), squeeze=False)
        colors = {"forward_compute": "tab:blue", "backward_compute": "tab:green", "kv_wait": "tab:red",
                  "dkv_wait": "tab:orange"}
        for ax, (world, res) in zip(axes[:, 0], cpu.items()):
            tl = res["timeline"]
            for rank, events in enumerate(tl["events_per_rank"]):
                for e in events:
                    ax.barh(rank, (e["t1"] - e["t0"]) * 1e3, left=e["t0"] * 1e3, color=colors[e["kind"]],
                            edgecolor="k", lw=0.3)
                    if e["kind"].endswith("compute"):
                        ax.text((e["t0"] + e["t1"]) / 2 * 1e3, rank, str(e["step"]), ha="center", va="center",
                                fontsize=7, color="w")
            alone = statistics.median(tl["transfer_alone_s"]) * 1e3
            ax.set_title(f"p2p zigzag, P={world}: per-step compute and time blocked on the next shard "
                         f"(one K/V transfer alone: {alone:.1f} ms)", fontsize=9)
            ax.set_yticks(range(int(world)), [f"rank {r}" for r in range(int(world))])
            ax.set_xlabel("ms")
            ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()],
                      labels=list(colors), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"bench_overlap_timeline{suffix}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    devices = results.get("device") or []
    for dev in devices if isinstance(devices, list) else [devices]:  # older runs stored one dict
        rows = [r for r in dev["kernels"] if "fwd_tflops" in r]
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 3.8))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["fwd_tflops"] for r in rows], 0.4, label="forward")
        ax.bar([i + 0.2 for i in x], [r["fwd_bwd_tflops"] for r in rows], 0.4, label="forward+backward")
        ax.set_xticks(list(x), [r["kernel"] for r in rows])
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"block kernels ({dev['dtype']}, causal block of {dev['block_len']})", fontsize=9)
        ax.legend(fontsize=8)
        sched = dev["rank_schedule"]
        x = range(len(sched))
        for offset, (label, key) in zip((-0.3, -0.1, 0.1, 0.3), [("ours fwd", ("fwd", "ours_tflops")),
                                                                   ("fused fwd", ("fwd", "fused_tflops")),
                                                                   ("ours fwd+bwd", ("fwd_bwd", "ours_tflops")),
                                                                   ("fused fwd+bwd", ("fwd_bwd", "fused_tflops"))]):
            ax2.bar([i + offset for i in x], [r[key[0]][key[1]] for r in sched], 0.2, label=label)
        ax2.set_xticks(list(x), [f"P={r['world_size']}\n{r['fwd_bwd']['efficiency']:.2f} of fused" for r in sched])
        ax2.set_ylabel("TFLOP/s")
        seq = dev.get("seq_len", results["shape"]["seq_len"])
        ax2.set_title(f"rank 0's zigzag schedule vs one fused SDPA of equal useful FLOPs ({dev['device']}, S={seq})",
                      fontsize=9)
        ax2.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"bench_device_kernels{suffix}_s{seq}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# ----------------------------------------------------------------------------------------------- CLI


def _machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "load_average_at_start": os.getloadavg(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_results", help="directory for the JSON and the PNG plots")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--comms", nargs="+", default=list(COMMS), choices=COMMS)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--tag", default="", help="appended to the output file names")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the plots of an earlier run's JSON")
    ap.add_argument("--no-cpu", action="store_true", help="skip the gloo runs")
    ap.add_argument("--device-bench", choices=["auto", "cuda", "cpu", "none"], default="auto",
                    help="kernel/schedule benchmark device (auto: cuda when available, else none)")
    ap.add_argument("--device-seq-lens", type=int, nargs="+", help="sequence lengths of the device benchmark "
                    "(default: --seq-len), e.g. 32768 131072")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            old = json.load(f)
        suffix = os.path.basename(args.replot)[len("bench_attention"):-len(".json")]
        print("wrote", ", ".join(plot(old, os.path.dirname(args.replot) or ".", suffix)))
        return 0
    shape = Shape(args.seq_len, args.batch, args.heads, args.kv_heads, args.head_dim)
    device_seq_lens = args.device_seq_lens or [args.seq_len]
    for world in args.world_sizes:
        for seq_len in {args.seq_len, *device_seq_lens}:
            if seq_len % (2 * world):
                ap.error(f"sequence length {seq_len} is not divisible by 2*P={2 * world}; pad it to a multiple")
    os.makedirs(args.out, exist_ok=True)
    results = {"machine": _machine(), "shape": asdict(shape), "reps": args.reps, "dtype_cpu": "float32"}
    if not args.no_cpu:
        results["cpu"] = cpu_benchmarks(args.world_sizes, shape, args.reps, args.comms, args.layouts)
    device = {"auto": "cuda" if torch.cuda.is_available() else None, "none": None}.get(args.device_bench,
                                                                                        args.device_bench)
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device-bench cuda needs a CUDA device; none is available here")
    if device is not None:
        print(f"device benchmarks on {device}", flush=True)
        results["device"] = [device_benchmarks(torch.device(device), Shape(n, *astuple(shape)[1:]), args.world_sizes,
                                               args.reps) for n in device_seq_lens]
    suffix = "_p" + "_".join(map(str, args.world_sizes)) + (f"_{args.tag}" if args.tag else "")
    results["plots"] = plot(results, args.out, suffix)
    from mcp_context.atomic import write_atomic

    path = os.path.join(args.out, f"bench_attention{suffix}.json")
    write_atomic(path, json.dumps(results, indent=1).encode())
    print(f"wrote {path} and {', '.join(results['plots'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
