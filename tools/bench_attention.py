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
importable), and one rank's step of each scheme in ``--device-schemes`` run on one device (the other
ranks' K/V simulated locally) against one fused SDPA call of equal useful FLOPs and one at the
per-rank length (ring-flash-attention's baseline): TFLOP/s (causal FLOPs counted once), the ratios,
peak memory, and the scheme's transfers modelled at NVLink and network rates.

The parts live in ``bench_cpu.py``, ``bench_device.py`` and ``bench_plots.py``; this file is the command line.
Writes ``bench_attention_p<P...>.jsonl`` as results come (one flushed JSON line per part: the machine,
the CPU results, each kernel and each rank-schedule row), then ``bench_attention_p<P...>.json`` (machine,
versions, shapes, every repetition) and PNG plots to ``--out``: a run that dies (out of memory, a
timeout) keeps every line written before. Timings on a shared CPU are noisy: only the ratios measured
in one run mean anything.

    python tools/bench_attention.py --out docs/img            # CPU, P = 2 and 4
    python tools/bench_attention.py --device-bench cuda --out results   # on a GPU machine
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, astuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mcp_context.cp_rules import COMM_TYPES  # noqa: E402
from tools.bench_cpu import Shape, cpu_benchmarks  # noqa: E402
from tools.bench_device import append_jsonl, device_benchmarks  # noqa: E402
from tools.bench_plots import plot  # noqa: E402

COMMS = COMM_TYPES  # every scheme in cp_rules.COMM_SCHEMES
LAYOUTS = ("zigzag", "contiguous", "striped")


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
    ap.add_argument("--device-schemes", nargs="+", default=["p2p"], choices=COMMS,
                    help="schemes of the one-rank device benchmark (default p2p), e.g. every one: "
                    + " ".join(COMMS))
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
    suffix = "_p" + "_".join(map(str, args.world_sizes)) + (f"_{args.tag}" if args.tag else "")
    lines = os.path.join(args.out, f"bench_attention{suffix}.jsonl")
    open(lines, "w").close()
    sink = append_jsonl(lines)
    results = {"machine": _machine(), "shape": asdict(shape), "reps": args.reps, "dtype_cpu": "float32"}
    sink({"part": "machine", **results})
    if not args.no_cpu:
        results["cpu"] = cpu_benchmarks(args.world_sizes, shape, args.reps, args.comms, args.layouts)
        sink({"part": "cpu", **results["cpu"]})
    device = {"auto": "cuda" if torch.cuda.is_available() else None, "none": None}.get(args.device_bench,
                                                                                        args.device_bench)
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device-bench cuda needs a CUDA device; none is available here")
    if device is not None:
        print(f"device benchmarks on {device}", flush=True)
        results["device"] = [device_benchmarks(torch.device(device), Shape(n, *astuple(shape)[1:]), args.world_sizes,
                                               args.reps, sink, schemes=args.device_schemes) for n in device_seq_lens]
    from mcp_context.atomic import write_atomic

    path = os.path.join(args.out, f"bench_attention{suffix}.json")
    write_atomic(path, json.dumps(results, indent=1).encode())  # before plotting: a plot error loses nothing
    results["plots"] = plot(results, args.out, suffix)
    write_atomic(path, json.dumps(results, indent=1).encode())
    print(f"wrote {lines}, {path} and {', '.join(results['plots'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
