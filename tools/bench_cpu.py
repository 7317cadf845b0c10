"""CPU part of ``tools/bench_attention.py``: P gloo processes time ``context_parallel_attention`` against
a single-process full attention over the same tokens and cores, and record the ring's timeline.

For each world size P, P processes with one thread each run every ``cp_comm_type`` and layout forward
and forward+backward, interleaved repetition by repetition with a full attention
(``F.scaled_dot_product_attention``, the same fused CPU kernel) run by rank 0 with P threads while the
other ranks wait. Reported: median ratio ours / full, the share of the ranks' agreement check, and the
figures that do not depend on the machine (load balance, masked waste, bytes counted by the comm
layer). For ``p2p`` zigzag the per-step timeline and the same transfer timed alone.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from mcp_context.cp_rules import comm_rule


@dataclass(frozen=True)
class Shape:
    """The attention the benchmarks time: global sequence length, batch, heads, KV heads, head dim."""

    seq_len: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int


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
        levels = comm_rule(comm).min_levels
        if levels > 1 and world < 2 ** levels:
            continue  # a hierarchy needs levels of at least 2
        sizes = (2,) * (levels - 1) + (world // 2 ** (levels - 1),) if levels > 1 else (world,)
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
    from mcp_context.engine import agree_on_documents
    from mcp_context.masks import CAUSAL, documents_mask
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

    def rank_check(calls: int = 20) -> float:
        """Seconds of one cross-rank agreement check (part of every ``ours`` call on gloo): the mean of
        ``calls`` back to back after a barrier, so the ranks' skew is not counted as its cost."""
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            engine.check_agreement(*leaves)
        return (time.perf_counter() - t0) / calls

    offsets = torch.tensor([0, shape.seq_len // 3, shape.seq_len], dtype=torch.int32)

    def packing_check(calls: int = 20) -> float:
        """Seconds of one step's packing check (parse the offsets, agree on them across the CP ranks: what
        runs once per step for a packed batch whatever ``check_ranks`` says), timed as ``rank_check``."""
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            agree_on_documents(documents_mask(offsets), groups)
        return (time.perf_counter() - t0) / calls

    reps_out = []
    for _ in range(reps):  # interleaved: ours and the baseline alternate within each repetition
        reps_out.append({"ours_fwd": _timed(lambda: ours(False)), "full_fwd": baseline(False),
                         "ours_fwd_bwd": _timed(lambda: ours(True)), "full_fwd_bwd": baseline(True),
                         "rank_check": rank_check(), "packing_check": packing_check()})
    if rank != 0:
        return {}  # the times above are the slowest rank's on every rank; the baseline ran on rank 0
    sched = layout_schedule(layout, world, shape.seq_len, CAUSAL, a2a_degree(comm, groups.sizes))
    return {"comm": comm, "layout": layout, "world_size": world, "reps": reps_out,
            "ratio_fwd": statistics.median(r["ours_fwd"] / r["full_fwd"] for r in reps_out),
            "ratio_fwd_bwd": statistics.median(r["ours_fwd_bwd"] / r["full_fwd_bwd"] for r in reps_out),
            "rank_check_share_fwd": statistics.median(r["rank_check"] / r["ours_fwd"] for r in reps_out),
            "rank_check_share_fwd_bwd": statistics.median(r["rank_check"] / r["ours_fwd_bwd"] for r in reps_out),
            "packing_check_share_fwd_bwd": statistics.median(r["packing_check"] / r["ours_fwd_bwd"]
                                                             for r in reps_out),
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
                  f"rank check {100 * res['rank_check_share_fwd']:.2f}% of fwd, "
                  f"{100 * res['rank_check_share_fwd_bwd']:.2f}% of fwd+bwd, packing check (once per step) "
                  f"{100 * res['packing_check_share_fwd_bwd']:.2f}% of one layer's fwd+bwd", flush=True)
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
