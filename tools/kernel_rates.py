#!/usr/bin/env python
"""Measure what the planner's machine profile needs: the fused op's rate by block shape, and where one
rank's step spends its GPU time.

1. ``rates``: the kernel ``auto`` picks (cuDNN on Hopper), bf16, on causal squares and full blocks of the
   shapes ring steps and gathered calls have, forward and forward+backward, TFLOP/s (causal pairs counted
   once). The planner interpolates these by a call's pairs (``plan/cost.py``).
2. ``profile``: one rank's fwd+bwd of each scheme under ``torch.profiler``: kernel launches and GPU time
   inside the attention ops and outside them (merges, accumulation, copies), and the host's wall time.

Writes one JSON line per result to ``--out`` (flushed as measured). Needs CUDA.

    python tools/kernel_rates.py --out runs/rates.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mcp_context.kernels import get_kernel  # noqa: E402
from mcp_context.masks import CAUSAL, CAUSAL_BLOCK, FULL_BLOCK  # noqa: E402
from tools.bench_device import _interleaved_seconds, append_jsonl  # noqa: E402

SQUARES = (1024, 2048, 4096, 8192, 16384, 32768)
FULL = ((1024, 1024), (2048, 2048), (2048, 4096), (4096, 2048), (4096, 4096), (2048, 14336), (2048, 30720),
        (8192, 8192), (8192, 57344), (16384, 16384), (8192, 122880))
ATTENTION = ("cudnn", "flash", "fmha", "sdpa", "attention")


def _rates(sink, heads: int, kv_heads: int, d: int, reps: int) -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    kernel = get_kernel("auto", dev, dtype, head_dim=d)
    for rows, keys, mask in [(n, n, CAUSAL_BLOCK) for n in SQUARES] + [(n, m, FULL_BLOCK) for n, m in FULL]:
        q, do = (torch.randn(1, heads, rows, d, device=dev, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(1, kv_heads, keys, d, device=dev, dtype=dtype) for _ in range(2))
        pairs = rows * (rows + 1) // 2 if mask.kind == "causal" else rows * keys
        flops = 4 * heads * d * pairs

        def fwd():
            return kernel.forward(q, k, v, mask, d ** -0.5)

        def fwd_bwd():
            out, lse = fwd()
            kernel.backward(do, q, k, v, out, lse, mask, d ** -0.5)

        t = _interleaved_seconds({"fwd": fwd, "fwd_bwd": fwd_bwd}, dev, reps)
        row = {"part": "rate", "kernel": kernel.name, "rows": rows, "keys": keys, "mask": mask.kind, "heads": heads,
               "kv_heads": kv_heads, "head_dim": d, "pairs": pairs, "fwd_s": t["fwd"], "fwd_bwd_s": t["fwd_bwd"],
               "fwd_tflops": flops / statistics.median(t["fwd"]) / 1e12,
               "fwd_bwd_tflops": 3.5 * flops / statistics.median(t["fwd_bwd"]) / 1e12}
        sink(row)
        print(f"  {mask.kind:6} {rows:>6} x {keys:<6} fwd {row['fwd_tflops']:5.0f}  fwd+bwd {row['fwd_bwd_tflops']:5.0f}"
              f" TFLOP/s", flush=True)


def _profile(sink, seq_len: int, cp: int, heads: int, kv_heads: int, d: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    from tools.rank_step import HARNESS, SCHEMES, rank_step, walked_call

    dev, dtype = torch.device("cuda"), torch.bfloat16
    kernel = get_kernel("auto", dev, dtype, head_dim=d)
    for comm in SCHEMES:
        step = rank_step(comm, cp, seq_len, CAUSAL, kernel, heads, kv_heads, d)
        run = walked_call(step, lambda *size: torch.randn(*size, device=dev, dtype=dtype), d)
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
        row = {"part": "profile", "harness": HARNESS, "comm": comm, "seq_len": seq_len, "cp": cp, "calls": step.calls,
               "wall_ms": start.elapsed_time(end), "kernels": len(kernels), "attention_kernels": len(inside),
               "other_kernels": len(outside), "attention_us": sum(e.device_time for e in inside),
               "other_us": sum(e.device_time for e in outside),
               "other_by_name": {n: [len(v), sum(v)] for n, v in sorted(names.items(), key=lambda x: -sum(x[1]))}}
        sink(row)
        print(f"  {comm:15} {seq_len // 1024}K/P{cp}: wall {row['wall_ms']:.2f} ms, {len(kernels)} kernels "
              f"({len(inside)} attention {row['attention_us'] / 1e3:.2f} ms, {len(outside)} other "
              f"{row['other_us'] / 1e3:.2f} ms)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON lines file")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile-seq-lens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--parts", nargs="+", default=["rates", "profile"], choices=["rates", "profile"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    sink = append_jsonl(args.out)
    sink({"part": "machine", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
          "cudnn": torch.backends.cudnn.version()})
    if "rates" in args.parts:
        _rates(sink, args.heads, args.kv_heads, args.head_dim, args.reps)
    if "profile" in args.parts:
        for s in args.profile_seq_lens:
            _profile(sink, s, args.cp, args.heads, args.kv_heads, args.head_dim)
    print(json.dumps({"wrote": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
