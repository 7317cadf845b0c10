#!/usr/bin/env python
"""Where one rank step's host time goes on a GPU, and what each compiled region and the side stream cost
or save there.

A step is host-bound when the host takes longer to issue it than the GPU takes to run it: on an H200
(docs/gpu/h200_run4_*) the ring's 32K/P8 step took 7.75 ms to issue beside 8.0 ms of GPU work, and 32K
over 64 ranks 4.0 ms beside 1.4 ms. For each case (scheme, S, P) this times one rank's fwd+bwd as
``tools/bench_device.py`` does (``tools/rank_step.py``: a ring walked by its member), cold and with the
host ahead (the GPU held busy while the host issues the step), with the host's issue time, in variants:

- ``shipped``: every fused region compiled, the side stream where the calls are long
  (``streams.SIDE_STREAM_MIN_FLOPS``);
- ``eager:<region>``: one region of ``merge.FUSED_REGIONS`` run eagerly (the compiled call's host cost
  against the eager form's extra kernels);
- ``through_dynamo``: every compiled call through ``torch.compile``'s wrappers (``regions.through_dynamo``),
  where the shipped step calls a layout seen before directly;
- ``in_order``: no side stream (``streams.inline``);
- ``side_stream``: the side stream for every call, short ones too (``streams.everywhere``): at 32K/P8 the
  shipped step runs in order since run 5, and this is what it weighs that against;
- ``graphed`` (CUDA only): replayed from CUDA graphs (``algorithms/graphs.py``, ``step_graphs``), one launch
  to issue;
- ``fused``: not our step but the floor under it, one fused SDPA call of equal useful FLOPs and its backward
  through autograd, as the benchmark's baseline (run 5's graphed one-call step still took 1.86 ms to issue: what
  of that any fwd+bwd through autograd pays, this row says);

and profiles the shipped step's host side (cProfile over ``--profile-steps`` steps), its time per step
grouped: the fused regions' calls (``regions.Region.__call__``: the compiled call path and its launches),
the attention ops' host side, the autograd engine, and the rest (the executor's Python and view ops); and
the CUDA runtime calls that take the host longest a step (``runtime_calls``: torch.profiler), where a call
that blocks the host shows (the one-call step's 2.0 ms is unexplained).
One JSON line per variant and per profile, written as measured.

``--bookkeeping`` (CPU): each case's step with its attention ops and fused regions doing no work (the ops
return outputs of the shapes and layouts the fused ops give, the regions return at once): what is left is the
host's own work around the calls (the executor's Python, views and allocations), the least of 7 runs of
``--profile-steps`` steps. Tiny shapes give the plan's structure without its sizes; the copies and fills the
step does for real (a message's packing) are small there.

    python tools/host_costs.py --device cpu --bookkeeping --cases p2p:256:8 a2a+p2p:256:8 a2a:64:8 \
        a2a+all_gather:1024:64:8 --heads 4 --kv-heads 2 --head-dim 8 --profile-steps 200 --out runs/bookkeeping.jsonl

On CPU without ``--bookkeeping`` it is a smoke run: the regions
run eagerly anyway, nothing is held busy, and the figures mean nothing; with ``--cpu-regions`` the regions
compile for the CPU (Inductor's C++), and tiny shapes weigh the host's cost of the compiled call path
(``shipped``, direct calls, against ``through_dynamo``), which is the same Python on any device.

    python tools/host_costs.py --out runs/host_costs.jsonl     # on a GPU: 32K/P8 p2p and a2a, 32K/P64 a2a+all_gather 8x8
    python tools/host_costs.py --device cpu --cpu-regions --cases p2p:256:8 a2a+all_gather:1024:64:8 \
        --heads 4 --kv-heads 2 --head-dim 8 --reps 30 --out runs/host_costs_cpu.jsonl
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import re
import statistics
import sys
from typing import Callable, ContextManager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mcp_context.algorithms import streams  # noqa: E402
from mcp_context.algorithms.calls import gpu_of  # noqa: E402
from mcp_context.kernels import Kernel, get_kernel  # noqa: E402
from mcp_context.kernels.math import MathKernel  # noqa: E402
from mcp_context.kernels.registry import FallbackKernel  # noqa: E402
from mcp_context.kernels.torch_sdpa import FUSED_OPS, FusedOp, TorchKernel  # noqa: E402
from mcp_context.masks import CAUSAL  # noqa: E402
from mcp_context.merge import FUSED_REGIONS  # noqa: E402
from mcp_context.regions import Region, through_dynamo  # noqa: E402
from tools.bench_device import (_equal_len, _interleaved_seconds, _queued_seconds, append_jsonl,  # noqa: E402
                                fused_call)
from tools.rank_step import captured_call, rank_step, regions_doing_nothing, walked_call  # noqa: E402

DEFAULT_CASES = ("p2p:32768:8", "a2a+all_gather:32768:64:8", "a2a:32768:8")
"""The two host-bound steps of the H200 runs, and the one-call step whose 2.0 ms of host issue is unexplained."""


def parse_case(text: str) -> tuple[str, int, int, int]:
    """``comm:S:P[:inner]`` (inner: the all-to-all degree of a hierarchical scheme, default 2)."""
    parts = text.split(":")
    try:
        comm, seq_len, cp = parts[0], int(parts[1]), int(parts[2])
        inner = int(parts[3]) if len(parts) == 4 else 2
    except (IndexError, ValueError):
        raise argparse.ArgumentTypeError(f"case {text!r} must be comm:S:P or comm:S:P:inner, "
                                         f"e.g. p2p:32768:8 or a2a+all_gather:32768:64:8") from None
    if len(parts) > 4:
        raise argparse.ArgumentTypeError(f"case {text!r} has {len(parts)} fields; comm:S:P[:inner] has 3 or 4")
    return comm, seq_len, cp, inner


def variants() -> dict[str, Callable[[], ContextManager]]:
    """The shipped step, each fused region eager in turn, every compiled call through dynamo, and the step
    with no side stream and with it for every call."""
    out: dict[str, Callable[[], ContextManager]] = {"shipped": contextlib.nullcontext}
    out.update({f"eager:{name}": region.eagerly for name, region in FUSED_REGIONS.items()})
    out["through_dynamo"] = through_dynamo
    out["in_order"] = streams.inline
    out["side_stream"] = streams.everywhere
    return out


def host_profile(fn: Callable[[], None], steps: int, device: torch.device) -> dict:
    """Host milliseconds per step of ``fn`` under cProfile, grouped (the profiler slows Python down, so
    the shares say more than the sums)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    region_call = Region.__call__.__code__
    region_file, region_line = region_call.co_filename, region_call.co_firstlineno
    total = regions = attention = engine = 0.0
    region_calls = 0
    for (path, line, name), (_, calls, own, cumulative, _) in pstats.Stats(prof).stats.items():
        total += own
        if (path, line) == (region_file, region_line):
            regions += cumulative
            region_calls += calls
        elif "_scaled_dot_product" in name:
            attention += own
        elif "run_backward" in name:
            engine += own
    per_step = {"fused_regions": regions, "attention_ops": attention, "autograd_engine": engine,
                "rest": total - regions - attention - engine, "total": total}
    return {"ms_per_step": {k: v / steps * 1e3 for k, v in per_step.items()},
            "fused_region_calls_per_step": region_calls / steps}


RUNTIME_CALLS_KEPT = 8
"""The CUDA runtime and driver calls a runtime profile keeps, by host time (``runtime_calls``)."""


def runtime_rows(events, steps: int) -> dict[str, dict[str, float]]:
    """The CUDA runtime and driver calls among ``events`` (``(name, count, host_us)``, summed over ``steps``
    steps), per step, the ``RUNTIME_CALLS_KEPT`` longest on the host first: a call that blocks the host (a
    pageable copy waits for the stream to reach it; ``cudaMalloc``, ``cudaFree``, a synchronisation) shows
    here, where the sync-debug count does not see it."""
    rows = {name: {"calls": count / steps, "host_us": host_us / steps} for name, count, host_us in events
            if re.match(r"cu(da)?[A-Z]", name)}  # cudaMemcpyAsync, cuLaunchKernel; not cudnn or cutlass kernels
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["host_us"])[:RUNTIME_CALLS_KEPT])


def runtime_calls(fn: Callable[[], None], steps: int, device: torch.device) -> dict[str, dict[str, float]]:
    """``runtime_rows`` of ``steps`` calls of ``fn`` under torch.profiler (nothing on a CPU: no CUDA calls)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda" and torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return runtime_rows(((e.key, e.count, e.cpu_time_total) for e in prof.key_averages()), steps)


def case_rows(comm: str, seq_len: int, cp: int, inner: int, device: torch.device, kernel: Kernel,
              rand: Callable[..., torch.Tensor], heads: int, kv_heads: int, head_dim: int, reps: int,
              profile_steps: int) -> list[dict]:
    """One row per variant and a profile row, for one rank's step (rank 0) of ``comm`` with ``kernel`` on
    tensors ``rand(*size)`` makes (as ``bench_device.schedule_row`` takes them)."""
    step = rank_step(comm, cp, seq_len, CAUSAL, kernel, heads, kv_heads, head_dim, inner)
    run = walked_call(step, rand, head_dim)

    base = {"part": "host_costs", "device": str(device), "comm": comm, "seq_len": seq_len, "cp": cp,
            "sizes": list(step.sizes), "attention_calls": step.calls_on(gpu_of(rand(1))), "heads_on_rank": step.heads}
    calls: dict[str, Callable[[], None]] = {}
    for name, context in variants().items():
        def call(context=context) -> None:
            with context():
                run()
        calls[name] = call
    calls["fused"] = fused_call(_equal_len(step.useful_pairs * step.heads // heads), rand, heads, kv_heads, head_dim)
    rows = []
    if device.type == "cuda":  # the step replayed from CUDA graphs: what is left of the host's issue time
        graphed, error = captured_call(step, rand, head_dim)
        if error is None:
            calls["graphed"] = graphed
        else:
            rows.append(dict(base, variant="graphed", error=error))
    cold = _interleaved_seconds(calls, device, reps)  # the variants in turn, each repetition: drift hits all alike
    longest = max(statistics.median(times) for times in cold.values())
    queued = _queued_seconds(calls, device, reps, longest) if device.type == "cuda" else {}
    for name in calls:
        row = dict(base, variant=name, cold_ms=statistics.median(cold[name]) * 1e3)
        if name in queued:
            row.update(host_ahead_ms=statistics.median(g for g, _, _ in queued[name]) * 1e3,
                       host_issue_ms=statistics.median(h for _, h, _ in queued[name]) * 1e3,
                       host_ahead=all(ok for _, _, ok in queued[name]))
        rows.append(row)
    rows.append(dict(base, variant="shipped", profile=host_profile(run, profile_steps, device),
                     runtime_api=runtime_calls(run, profile_steps, device)))
    return rows


def _token_major_like(x: torch.Tensor, dims: int) -> torch.Tensor:
    """An uninitialised ``[b, h, s, dims]`` view of ``[b, s, h, dims]`` storage: how a fused op lays out what it
    returns for the executor's token-major inputs."""
    b, h, n, _ = x.shape
    return torch.empty((b, n, h, dims), dtype=x.dtype, device=x.device).transpose(1, 2)


def _no_work_forward(q, k, v, causal, scale):
    return _token_major_like(q, v.shape[-1]), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)


def _no_work_backward(dout, q, k, v, out, lse, causal, scale):
    return tuple(_token_major_like(x, x.shape[-1]) for x in (q, k, v))


NO_WORK = FusedOp("no_work", FUSED_OPS["cpu_flash"].capabilities, _no_work_forward, _no_work_backward)
"""An attention op that returns what the fused ops return and computes nothing (``--bookkeeping``)."""


def bookkeeping_row(comm: str, seq_len: int, cp: int, inner: int, heads: int, kv_heads: int, head_dim: int,
                    steps: int, runs: int = 7) -> dict:
    """Host milliseconds a step of rank 0's fwd+bwd on the CPU with no work in the attention ops and the fused
    regions (``NO_WORK``, ``regions_doing_nothing``), through the chain ``auto`` builds on a CPU (the op, then the
    math kernel): the least of ``runs`` runs of ``steps`` steps."""
    import time

    kernel = FallbackKernel([TorchKernel(NO_WORK), MathKernel()])
    step = rank_step(comm, cp, seq_len, CAUSAL, kernel, heads, kv_heads, head_dim, inner)
    gen = torch.Generator().manual_seed(0)
    run = walked_call(step, lambda *size: torch.randn(*size, generator=gen), head_dim)
    times = []
    with regions_doing_nothing():
        for _ in range(3):
            run()
        for _ in range(runs):
            t0 = time.perf_counter()
            for _ in range(steps):
                run()
            times.append((time.perf_counter() - t0) / steps)
    return {"part": "host_costs", "device": "cpu", "comm": comm, "seq_len": seq_len, "cp": cp,
            "sizes": list(step.sizes), "attention_calls": step.calls, "variant": "bookkeeping",
            "host_ms": min(times) * 1e3, "host_ms_median": statistics.median(times) * 1e3, "steps": steps, "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", type=parse_case, default=[parse_case(c) for c in DEFAULT_CASES],
                    help="comm:S:P[:inner] each (default: %(default)s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--out", required=True, help="JSON lines, one per variant and profile, written as measured")
    ap.add_argument("--bookkeeping", action="store_true",
                    help="CPU only: time each case with no work in the attention ops and fused regions (the host's "
                         "own work around the calls), instead of the variants")
    ap.add_argument("--cpu-regions", action="store_true",
                    help="compile the fused regions for the CPU too (Inductor's C++): the compiled call path's host "
                         "cost measured on a CPU")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.bookkeeping and device.type != "cpu":
        ap.error(f"--bookkeeping times the host's own work on the CPU; got --device {args.device} (use --device cpu)")
    if args.cpu_regions:
        for region in FUSED_REGIONS.values():
            region.devices = (*region.devices, "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernel = get_kernel("auto", device, dtype, head_dim=args.head_dim)
    gen = torch.Generator().manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device, dtype)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    open(args.out, "w").close()  # this run's rows only
    write = append_jsonl(args.out)
    for comm, seq_len, cp, inner in args.cases:
        if args.bookkeeping:
            row = bookkeeping_row(comm, seq_len, cp, inner, args.heads, args.kv_heads, args.head_dim,
                                  args.profile_steps)
            write(row)
            print(f"  {comm} {seq_len}/{cp} bookkeeping {row['host_ms']:.3f} ms a step (least of {row['runs']}; median "
                  f"{row['host_ms_median']:.3f}), {row['attention_calls']} calls a pass", flush=True)
            continue
        for row in case_rows(comm, seq_len, cp, inner, device, kernel, rand, args.heads, args.kv_heads, args.head_dim,
                             args.reps, args.profile_steps):
            write(row)
            if "profile" in row:
                ms = row["profile"]["ms_per_step"]
                print(f"  {comm} {seq_len}/{cp} profile (ms a step, under cProfile): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in ms.items())
                      + f"; {row['profile']['fused_region_calls_per_step']:.0f} fused region calls", flush=True)
            elif "error" in row:
                print(f"  {comm} {seq_len}/{cp} {row['variant']:24} failed: {row['error']}", flush=True)
            else:
                extra = (f", host ahead {row['host_ahead_ms']:.2f} ms, host issue {row['host_issue_ms']:.2f} ms"
                         + ("" if row["host_ahead"] else " (the host fell behind the hold)")) if "host_issue_ms" in row else ""
                print(f"  {comm} {seq_len}/{cp} {row['variant']:24} cold {row['cold_ms']:.2f} ms{extra}", flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
