#!/usr/bin/env python
"""Fit a planner profile's per-call overhead and step bandwidth to measured GPU figures, and show how
well the calibrated model predicts every measured rank step.

Inputs are what ``tools/kernel_rates.py`` and ``tools/bench_attention.py --device-schemes ...`` write on
a GPU: the fused op's rates by block shape (the profile's ``causal_tflops`` / ``full_tflops`` tables),
one profiled fwd+bwd per scheme (GPU time outside the attention kernels), and each scheme's measured
rank step. The fit:

- ``memory_bandwidth_gbps``: the bytes the step moves outside attention (``plan.cost.task_bytes`` and
  ``layer_bytes`` over the tasks the engine runs) over the profiled GPU time outside attention, the
  median over the profiled steps;
- ``call_overhead_us``: what the measured steps take beyond their calls at the tables' rates and their
  bytes at that bandwidth, per attention call (forward and backward each count one), the median over
  the measured steps at ``--fit-world-size``;
- ``host_layer_us`` and ``host_call_us`` (with ``--host``): the least-squares line through the host's time
  to issue each step timed with the host ahead, by its attention calls.

Then every measured step is predicted with the fitted profile and printed beside its measurement; where
``--rates`` holds ``occupancy`` rows (``tools/kernel_rates.py --parts occupancy``), the planner's occupancy
model is printed beside the busy share they measured; with ``--host``, the GPU time of the steps timed with
the host ahead beside the model's.

    python tools/calibrate_profile.py --profile h200_nvlink_ib --rates docs/gpu/h200_run1_rates.jsonl \\
        --bench docs/gpu/h200_run1_bench.json --host docs/gpu/h200_run4_bench_32k.jsonl docs/gpu/h200_run4_picks.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel  # noqa: E402
from mcp_context.masks import CAUSAL, CAUSAL_BLOCK, FULL_BLOCK  # noqa: E402
from mcp_context.plan.cost import Accumulation, layer_bytes, occupancy, step_compute  # noqa: E402
from mcp_context.plan.dryrun import RankShape, RankTraffic  # noqa: E402
from mcp_context.plan.profiles import MachineProfile, load_profile  # noqa: E402
from mcp_context.schedule import BlockTask  # noqa: E402
from tools.rank_step import rank_step  # noqa: E402


def _lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


MEASURED_ENGINE = Accumulation(lone_kv=False, through=True)
"""How the engine of the shipped H200 runs (docs/gpu, 2026-11-25, ``tools/rank_step.harness()`` 1) held every
plan's results: in fp32 accumulators, with result copies; a single-call plan's direct results and the
results held as their rows need came after them, so the fit prices the steps that were measured."""


def predicted_step(profile: MachineProfile, comm: str, seq_len: int, cp: int, heads: int, kv_heads: int,
                   head_dim: int, harness: int = 1, inner: int = 2) -> tuple[float, float, int]:
    """``(seconds, calls, bytes)`` of one rank's fwd+bwd of ``comm`` (rank 0, batch 1, bf16; ``inner``: the
    all-to-all degree of a hierarchical kind), compute only, as the timed step ran (``harness``,
    ``tools/rank_step.harness()``): 1, the measured engine (``MEASURED_ENGINE``) over every member's K/V; 2,
    the engine that holds results as their rows need, over the K/V the rank holds, one call per task, merging
    one block at a time; 3, that with its calls sized for the GPU (``algorithms/calls.py``); 4, that merging
    several blocks at a time; 5, that with one call per task again (today's default)."""
    step = rank_step(comm, cp, seq_len, CAUSAL, TorchKernel(FUSED_OPS["cudnn"]), heads, kv_heads, head_dim,
                     inner=inner)
    kv_rows = step.kv_rows if harness == 1 else step.walked()[1]
    held = MEASURED_ENGINE if harness == 1 else Accumulation.of(step.plan.tasks, kv_rows)
    if harness in (2, 3):  # that engine merged a row's blocks one at a time
        held = dataclasses.replace(held, arities=(2, 2))
    shape = RankShape(seq_len, 1, step.heads, step.kv_heads, head_dim, torch.bfloat16)
    traffic = RankTraffic(0, {}, {}, tasks=tuple(step.plan.tasks), q_rows=step.q_rows, kv_rows=kv_rows)
    sized = harness in (3, 4)
    fwd, bwd = step_compute([traffic], shape, 1, profile, held, planned=sized)
    extra = layer_bytes(shape, step.heads, step.kv_heads, step.plan.tasks, step.q_rows, kv_rows, held,
                        ring=harness != 1 and step.ring)
    calls = step.calls_on(profile.gpu, sized)
    return sum(fwd) + sum(bwd) + extra / (profile.memory_bandwidth_gbps * 1e9), calls, extra


def _moved_bytes(profile: MachineProfile, comm: str, seq_len: int, cp: int, heads: int, kv_heads: int,
                 head_dim: int, harness: int) -> float:
    """Bytes outside attention of one step: the time at 1 GB/s and no call overhead, in seconds = GB."""
    unit = dataclasses.replace(profile, memory_bandwidth_gbps=1.0, call_overhead_us=1e-9,
                               causal_tflops=((1.0, 1e12, 1e12),), full_tflops=((1.0, 1e12, 1e12),))
    return predicted_step(unit, comm, seq_len, cp, heads, kv_heads, head_dim, harness)[0] * 1e9


def calibrate(profile: MachineProfile, rates: list[dict], bench: dict, fit_world: int = 8
              ) -> tuple[MachineProfile, list[dict]]:
    heads, kv_heads, d = (bench["shape"][k] for k in ("heads", "kv_heads", "head_dim"))
    profiled = [r for r in rates if r["part"] == "profile"]
    if not profiled:
        raise ValueError("the --rates lines hold no 'profile' rows, which the step bandwidth is fitted to; "
                         "tools/kernel_rates.py --parts profile writes them (make test-gpu: profile.jsonl)")
    bandwidth = statistics.median(_moved_bytes(profile, r["comm"], r["seq_len"], r["cp"], heads, kv_heads, d,
                                               r.get("harness", 1)) / (r["other_us"] * 1e-6) / 1e9 for r in profiled)
    profile = dataclasses.replace(profile, memory_bandwidth_gbps=round(bandwidth), call_overhead_us=1e-9)
    steps = [(dev["seq_len"], r) for dev in bench["device"] for r in dev["rank_schedule"] if "error" not in r]
    over = []
    for seq_len, r in steps:
        if r["world_size"] == fit_world:
            model, calls, _ = predicted_step(profile, r["comm"], seq_len, r["world_size"], heads, kv_heads, d,
                                             r.get("harness", 1))
            over.append((statistics.median(r["fwd_bwd"]["ours_s"]) - model) / (2 * calls) * 1e6)
    profile = dataclasses.replace(profile, call_overhead_us=round(max(statistics.median(over), 0.0), 1))
    rows = []
    for seq_len, r in steps:
        model = predicted_step(profile, r["comm"], seq_len, r["world_size"], heads, kv_heads, d, r.get("harness", 1))[0]
        measured = statistics.median(r["fwd_bwd"]["ours_s"])
        rows.append({"seq_len": seq_len, "cp": r["world_size"], "comm": r["comm"], "measured_ms": measured * 1e3,
                     "predicted_ms": model * 1e3, "error": model / measured - 1})
    return profile, rows


def host_steps(rows: list[dict]) -> list[tuple[int, float]]:
    """``(attention calls per pass, host seconds to issue the fwd+bwd)`` of every rank step timed with the host
    ahead in ``rows``: the benchmark's JSON lines (``rank_schedule`` rows) or ``tools/bench_picks.py``'s
    (``pick`` rows, their ``step``)."""
    out = []
    for r in rows:
        step = r.get("step", r) if r.get("part") in ("pick", "rank_schedule") else {}
        host = step.get("fwd_bwd", {}).get("host_issue_s")
        if host:
            out.append((step["attention_calls"], statistics.median(host)))
    return out


HEADS = {"llama3_8b": (32, 8), "llama3_70b": (64, 8)}
"""Query and KV heads of the models ``tools/bench_picks.py`` times (``tools/plan_grid.MODELS``)."""


def gpu_bound_rows(profile: MachineProfile, rows: list[dict]) -> list[dict]:
    """Every rank step in ``rows`` timed with the host ahead (its GPU time: ``queued_s``, the benchmark's
    ``rank_schedule`` rows at 32 / 8 heads and the picks' ``step``) beside the profile's prediction of its GPU
    time (``predicted_step``, today's engine): the check of the attention tables, the call overhead and the
    occupancy model, which the cold steps' host time hides at short lengths."""
    out = []
    for r in rows:
        if r.get("part") == "pick" and "step" in r:
            step, (heads, kv_heads), name = r["step"], HEADS[r["model"]], r["pick"]
        elif r.get("part") == "rank_schedule":
            step, (heads, kv_heads), name = r, (32, 8), r["comm"]
        else:
            continue
        queued = step.get("fwd_bwd", {}).get("queued_s")
        if not queued:
            continue
        args = (step["comm"], r["seq_len"], step["world_size"], heads, kv_heads, 128, 2, step["sizes"][0])
        model, calls, _ = predicted_step(profile, *args)
        bare = predicted_step(dataclasses.replace(profile, call_overhead_us=1e-9), *args)[0]
        measured = statistics.median(queued)
        out.append({"seq_len": r["seq_len"], "cp": step["world_size"], "heads": heads, "step": name, "calls": calls,
                    "measured_ms": measured * 1e3, "predicted_ms": model * 1e3, "error": model / measured - 1,
                    "without_overhead_ms": bare * 1e3})
    return out


def fit_gpu_time(rows: list[dict]) -> tuple[float, float, float]:
    """``(rate scale, call overhead in µs, worst relative error)``: the least-squares fit, in relative error,
    of ``gpu_bound_rows``' measured GPU times to ``scale x`` the model's time without the per-call overhead
    plus the overhead once forward and once backward per call. With the rate tables and the steps measured
    in one run the scale is near 1 and the overhead is the GPU's own per call (the shipped ``call_overhead_us``
    was fitted to cold steps, where the host's gaps between calls count too)."""
    a = [r["without_overhead_ms"] / r["measured_ms"] for r in rows]
    c = [2 * r["calls"] * 1e-3 / r["measured_ms"] for r in rows]  # per µs of overhead, in ms
    saa, sac, scc = sum(x * x for x in a), sum(x * y for x, y in zip(a, c)), sum(y * y for y in c)
    det = saa * scc - sac * sac
    scale, overhead = (sum(a) * scc - sac * sum(c)) / det, (saa * sum(c) - sac * sum(a)) / det
    worst = max(abs(scale * x + overhead * y - 1) for x, y in zip(a, c))
    return scale, overhead, worst


def occupancy_rows(profile: MachineProfile, rates: list[dict]) -> list[dict]:
    """The planner's occupancy model (``plan.cost.occupancy``) against ``tools/kernel_rates.py``'s ``occupancy``
    rows: per shape and head count, the share of the GPU a call keeps busy, measured as its FLOP rate per head
    over the same shape's at the most heads timed (their GPU time with the host ahead where timed), and as the
    model gives it (the same ratio of its shares), forward and backward."""
    timed = [r for r in rates if r.get("part") == "occupancy"]
    out = []
    for r in timed:
        shape = (r["rows"], r["keys"], r["mask"])
        most = max((x for x in timed if (x["rows"], x["keys"], x["mask"]) == shape), key=lambda x: x["heads"])
        task = BlockTask((0, r["rows"]), (0, r["keys"]), CAUSAL_BLOCK if r["mask"] == "causal" else FULL_BLOCK)
        model = [a / b for a, b in zip(occupancy(profile, task, r["heads"]), occupancy(profile, task, most["heads"]))]
        seconds = {}
        for x in (r, most):
            fwd = statistics.median(x.get("queued_fwd_s") or x["fwd_s"])
            both = statistics.median(x.get("queued_fwd_bwd_s") or x["fwd_bwd_s"])
            seconds[x["heads"]] = (fwd / x["heads"], (both - fwd) / x["heads"])  # per head
        measured = [seconds[most["heads"]][i] / seconds[r["heads"]][i] for i in range(2)]
        out.append({"rows": r["rows"], "keys": r["keys"], "mask": r["mask"], "heads": r["heads"],
                    "measured_fwd": measured[0], "model_fwd": model[0], "measured_bwd": measured[1],
                    "model_bwd": model[1]})
    return out


def fit_host(steps: list[tuple[int, float]]) -> tuple[float, float]:
    """``(host_layer_us, host_call_us)``: the least-squares line through the host issue times by call count
    (at least two distinct counts)."""
    if len({c for c, _ in steps}) < 2:
        raise ValueError(f"the host fit needs steps of at least two call counts; got {sorted({c for c, _ in steps})}: "
                         f"pass the benchmark's and the picks' JSON lines (--host), which time 1 to 8 calls")
    mean_c = statistics.fmean(c for c, _ in steps)
    mean_h = statistics.fmean(h for _, h in steps)
    slope = (sum((c - mean_c) * (h - mean_h) for c, h in steps) / sum((c - mean_c) ** 2 for c, _ in steps))
    return round((mean_h - slope * mean_c) * 1e6), round(slope * 1e6)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True, help="shipped profile name or YAML path (its tables are used)")
    ap.add_argument("--rates", required=True, help="tools/kernel_rates.py's JSON lines (with 'profile' rows)")
    ap.add_argument("--bench", required=True, help="tools/bench_attention.py's JSON (every scheme)")
    ap.add_argument("--fit-world-size", type=int, default=8)
    ap.add_argument("--host", nargs="+", default=[], metavar="JSONL",
                    help="JSON lines of rank steps timed with the host ahead (the benchmark's, tools/bench_picks.py's): "
                         "fit host_layer_us and host_call_us to their host issue times")
    args = ap.parse_args(argv)
    with open(args.bench) as f:
        bench = json.load(f)
    try:
        profile, rows = calibrate(load_profile(args.profile), _lines(args.rates), bench, args.fit_world_size)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"memory_bandwidth_gbps: {profile.memory_bandwidth_gbps:.0f}\ncall_overhead_us: {profile.call_overhead_us}")
    if args.host:
        steps = host_steps([r for path in args.host for r in _lines(path)])
        layer_us, call_us = fit_host(steps)
        print(f"host_layer_us: {layer_us}\nhost_call_us: {call_us}   # {len(steps)} steps, "
              f"{min(c for c, _ in steps)} to {max(c for c, _ in steps)} calls")
        print("GPU time of the steps timed with the host ahead, against the fitted profile's prediction:")
        print(f"{'S':>7} {'P':>3} {'heads':>5} {'step':28} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
        bound = gpu_bound_rows(profile, [r for path in args.host for r in _lines(path)])
        for r in bound:
            print(f"{r['seq_len']:>7} {r['cp']:>3} {r['heads']:>5} {r['step']:28} {r['measured_ms']:>12.2f} "
                  f"{r['predicted_ms']:>13.2f} {r['error']:>+7.1%}")
        scale, overhead, worst = fit_gpu_time(bound)
        print(f"fitted to these: the model's time x {scale:.3f} (the tables' rates x {1 / scale:.3f}; from another run "
              f"than the steps, the scale is the runs' difference), call overhead {overhead:.1f} us each way; worst "
              f"error {worst:.1%}")
        print("Cold steps (the host's issue time included), against the fitted profile's GPU time:")
    occupied = occupancy_rows(profile, _lines(args.rates))
    if occupied:
        print("Busy share of the GPU by heads, relative to the most heads timed (measured: FLOP rate per head):")
        print(f"{'mask':6} {'rows':>5} {'keys':>6} {'heads':>5} {'fwd measured':>13} {'model':>6} {'bwd measured':>13} "
              f"{'model':>6}")
        for r in occupied:
            print(f"{r['mask']:6} {r['rows']:>5} {r['keys']:>6} {r['heads']:>5} {r['measured_fwd']:>13.2f} "
                  f"{r['model_fwd']:>6.2f} {r['measured_bwd']:>13.2f} {r['model_bwd']:>6.2f}")
    print(f"{'S':>7} {'P':>3} {'scheme':15} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
    for r in rows:
        print(f"{r['seq_len']:>7} {r['cp']:>3} {r['comm']:15} {r['measured_ms']:>12.2f} {r['predicted_ms']:>13.2f} "
              f"{r['error']:>+7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
