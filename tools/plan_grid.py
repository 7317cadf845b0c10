#!/usr/bin/env python
"""The planner's pick of a CP scheme over a grid of sequence lengths and CP sizes, with its calibrated
model's figures: which scheme is fastest for one attention layer, communication included.

For each model (attention heads only: Llama-3-8B's 32/8 and Llama-3-70B's 64/8, d = 128, TP 1) and each
``(S, P)``, the zigzag candidates of CP size ``P`` that ``python -m mcp_context.plan`` would consider with
two levels at most (every flat scheme; the hierarchical ones with an all-to-all over 2, 4 or 8 adjacent
ranks, the sizes one node of 8 holds) are dry-run and predicted (``plan.evaluate``) on ``P`` GPUs, 8 a
node; the table lists the fastest, its predicted
forward+backward ms (or the host's time to issue it, where longer: ``Prediction.bound_s``), its compute
alone, the host's issue time, the share of its calls' time the GPU's SMs are busy (``Prediction.busy``) and
whether its step can be replayed from CUDA graphs, its efficiency against one fused call of equal useful FLOPs at
the profile's rate (the benchmark's baseline, predicted), and the runner-up per family. Memory is not
ranked here (``python -m mcp_context.plan`` does that for a whole model).

    python tools/plan_grid.py --profile h200_nvlink_ib --out docs/img/plan_grid_h200.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm import tqdm  # noqa: E402

from mcp_context.plan import PlanRequest, evaluate, load_profile  # noqa: E402
from mcp_context.plan.candidates import enumerate_candidates  # noqa: E402
from mcp_context.plan.cost import FWD_BWD_FLOP_FACTOR, _rate  # noqa: E402
from mcp_context.recipes.schema import ModelConfig  # noqa: E402

MODELS = {
    "llama3_8b": ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                             kv_channels=128, ffn_hidden_size=14336, vocab_size=None),
    "llama3_70b": ModelConfig(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                              kv_channels=128, ffn_hidden_size=28672, vocab_size=None),
}


def fused_equal_flops_s(profile, seq_len: int, cp: int, heads: int, d: int) -> float:
    """Predicted fwd+bwd seconds of one fused causal call doing one rank's share of the work (S^2 / 2P
    pairs), at the profile's causal rate for that call's length."""
    pairs = seq_len * (seq_len + 1) / 2 / cp
    _, both = _rate(profile.causal_tflops, math.sqrt(2 * pairs))
    return FWD_BWD_FLOP_FACTOR * 4 * d * heads * pairs / (both * 1e12)


def grid(profile_name: str, seq_lens, cps, models) -> list[dict]:
    profile = load_profile(profile_name)
    cells = [(m, s, p) for m in models for s in seq_lens for p in cps]
    rows = []
    for name, seq_len, cp in tqdm(cells, desc="grid", unit="cell"):
        model = MODELS[name]
        req = PlanRequest(model, seq_len, cp, profile)
        valid, _ = enumerate_candidates([cp], seq_len, model.num_attention_heads, model.num_query_groups)
        chosen = [c for c in valid if c.layout == "zigzag" and len(c.sizes) <= 2 and c.sizes[0] in (cp, 2, 4, 8)]
        evaluated = sorted((evaluate(req, c) for c in chosen), key=lambda r: r.prediction.bound_s)
        best, cand = evaluated[0].prediction, evaluated[0].candidate
        fused = fused_equal_flops_s(profile, seq_len, cp, model.num_attention_heads, model.kv_channels)
        by_comm = {}
        for r in evaluated:
            by_comm.setdefault(r.candidate.comm, (r.prediction.bound_s * 1e3, r.candidate.label()))
        rows.append({"model": name, "seq_len": seq_len, "cp": cp, "pick": cand.label(), "comm": cand.comm,
                     "sizes": list(cand.sizes), "predicted_ms": best.bound_s * 1e3, "compute_ms": best.compute_s * 1e3,
                     "host_ms": best.host_s * 1e3, "busy": best.busy, "replayable": evaluated[0].replayable,
                     "fused_equal_flops_ms": fused * 1e3,
                     "efficiency": fused / best.bound_s,
                     "best_per_scheme": {k: {"ms": v[0], "candidate": v[1]} for k, v in by_comm.items()}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="h200_nvlink_ib")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072, 1048576])
    ap.add_argument("--cps", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--out", help="JSON file for the rows")
    args = ap.parse_args(argv)
    rows = grid(args.profile, args.seq_lens, args.cps, args.models)
    print(f"{'model':11} {'S':>8} {'P':>3}  {'pick':28} {'ms':>8} {'compute':>8} {'host':>8} {'busy':>5} "
          f"{'eff':>5}  best of each scheme (ms)")
    for r in rows:
        others = ", ".join(f"{k} {v['ms']:.2f}" for k, v in sorted(r["best_per_scheme"].items(), key=lambda x: x[1]["ms"]))
        print(f"{r['model']:11} {r['seq_len']:>8} {r['cp']:>3}  {r['pick']:28} {r['predicted_ms']:>8.2f} "
              f"{r['compute_ms']:>8.2f} {r['host_ms']:>8.2f} {r['busy']:>5.2f} {r['efficiency']:>5.2f}  {others}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"profile": args.profile, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
