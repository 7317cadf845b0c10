#!/usr/bin/env python
"""Time the planner's pick at each cell of its grid: one rank's step of the scheme the calibrated planner
chose (``tools/plan_grid.py``'s JSON: comm and hierarchy per model, S and P), run on one device as the
benchmark runs it (``bench_device.schedule_row``: a ring walked as its member walks it, the other kinds
over the K/V their collectives deliver), against one fused call of equal useful FLOPs, beside the planner's
predicted efficiency of the same compute (its fused time over its compute time: communication is not on
one device; its bytes and their time at the benchmark's link rates are in each row) and of the same step
(over the longer of its compute and the host's time to issue it, the grid's ``host_ms``: the measured step
is timed from its first launch, so a host-bound step is the host's time).

The issue's target is the measured figure at >= 0.95 in every cell. A cell whose rank step would do more
than ``--max-tflop`` of fwd+bwd work (1M tokens over 8 or 16 ranks: seconds per repetition) is listed as
skipped, with the reason. Each row goes to ``--out`` (JSON lines) as soon as it is measured.

    python tools/bench_picks.py --grid docs/img/plan_grid_h200.json --out runs/picks.jsonl   # on a GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mcp_context.plan.cost import FWD_BWD_FLOP_FACTOR  # noqa: E402
from tools.bench_cpu import Shape  # noqa: E402
from tools.bench_device import append_jsonl, schedule_row  # noqa: E402
from tools.gpu_report import TARGETS  # noqa: E402
from tools.plan_grid import MODELS  # noqa: E402

TARGET = TARGETS["pick"]


def rank_tflop(seq_len: int, cp: int, heads: int, head_dim: int) -> float:
    """TFLOP of one rank's causal fwd+bwd (``FWD_BWD_FLOP_FACTOR`` x the forward's 4 d FLOPs per visible pair
    and head)."""
    return FWD_BWD_FLOP_FACTOR * 4 * head_dim * heads * seq_len * (seq_len + 1) / 2 / cp / 1e12


def bench_picks(rows: list[dict], device: torch.device, reps: int, max_tflop: float, sink) -> list[dict]:
    """Measure each grid row's pick; returns one result per row (``skipped`` with the reason, or the
    measured and predicted efficiencies)."""
    from mcp_context.kernels import get_kernel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(3)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device, dtype)

    results = []
    for cell in rows:
        model = MODELS[cell["model"]]
        h, hk, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
        out = {"model": cell["model"], "seq_len": cell["seq_len"], "cp": cell["cp"], "pick": cell["pick"],
               "comm": cell["comm"], "sizes": cell["sizes"],
               "predicted_compute_efficiency": cell["fused_equal_flops_ms"] / cell["compute_ms"],
               "predicted_step_efficiency": cell["fused_equal_flops_ms"] / max(cell["compute_ms"], cell.get("host_ms", 0.0)),
               "predicted_efficiency": cell["efficiency"]}
        work = rank_tflop(cell["seq_len"], cell["cp"], h, d)
        if work > max_tflop:
            out["skipped"] = f"{work:.0f} TFLOP per fwd+bwd, over --max-tflop {max_tflop:g}"
        else:
            step = {"world_size": cell["cp"], "comm": cell["comm"], "rank": 0}
            kernel = get_kernel("auto", device, dtype, head_dim=d)
            inner = cell["sizes"][0] if len(cell["sizes"]) > 1 else None
            schedule_row(step, device, kernel, rand, Shape(cell["seq_len"], 1, h, hk, d), reps, inner)
            assert step["sizes"] == cell["sizes"], (step["sizes"], cell["sizes"])  # the pick's own hierarchy
            out.update(step=step, efficiency=step["fwd_bwd"]["efficiency"])
            out["measured_over_predicted"] = out["efficiency"] / out["predicted_step_efficiency"]
        results.append(out)
        sink({"part": "pick", "device": str(device), **out})
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", default="docs/img/plan_grid_h200.json", help="tools/plan_grid.py's JSON")
    ap.add_argument("--seq-lens", type=int, nargs="+", help="only these S (default: every S of the grid)")
    ap.add_argument("--cps", type=int, nargs="+", help="only these P (default: every P of the grid)")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), help="only these models (default: both)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tflop", type=float, default=600.0,
                    help="skip a cell whose rank step does more fwd+bwd work than this (about 1 s on an H200)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run, not a figure")
    ap.add_argument("--out", required=True, help="JSON-lines file of the results")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA device; none is available here (--device cpu runs a smoke test)")
    with open(args.grid) as f:
        grid = json.load(f)
    rows = [r for r in grid["rows"] if (args.seq_lens is None or r["seq_len"] in args.seq_lens)
            and (args.cps is None or r["cp"] in args.cps) and (args.models is None or r["model"] in args.models)]
    if not rows:
        ap.error(f"no cell of {args.grid} matches --seq-lens {args.seq_lens} --cps {args.cps} --models {args.models}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    open(args.out, "w").close()
    sink = append_jsonl(args.out)
    sink({"part": "grid", "grid": args.grid, "profile": grid.get("profile"), "reps": args.reps,
          "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None})
    results = bench_picks(rows, torch.device(args.device), args.reps, args.max_tflop, sink)
    print(f"{'model':11} {'S':>8} {'P':>3}  {'pick':28} {'measured':>8} {'predicted':>9} {'ratio':>6}")
    for r in results:
        if "skipped" in r:
            print(f"{r['model']:11} {r['seq_len']:>8} {r['cp']:>3}  {r['pick']:28} skipped: {r['skipped']}")
            continue
        print(f"{r['model']:11} {r['seq_len']:>8} {r['cp']:>3}  {r['pick']:28} {r['efficiency']:>8.3f} "
              f"{r['predicted_step_efficiency']:>9.3f} {r['measured_over_predicted']:>6.2f}")
    measured = [r["efficiency"] for r in results if "efficiency" in r]
    if measured:
        met = sum(e >= TARGET for e in measured)
        print(f"fwd+bwd vs one fused call of equal useful FLOPs (compute only): >= {TARGET} in {met} of "
              f"{len(measured)} cells measured; lowest {min(measured):.3f}, median {statistics.median(measured):.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
