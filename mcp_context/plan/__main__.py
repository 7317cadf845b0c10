"""``python -m mcp_context.plan``: plan context parallelism for a model, a sequence and a machine.

Examples::

    python -m mcp_context.plan --recipe recipes/llama3_70b_1m_hcp.yaml --gpus 64 --tp 8 --pp 1
    python -m mcp_context.plan --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn-hidden 28672 \\
        --seq-len 1048576 --gpus 64 --tp 8 --profile h200_nvlink_ib --json plan.json
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .model import ModelShape
from .planner import PlanRequest, plan, with_gpus_per_node
from .profiles import load_profile, shipped_profiles
from .report import plan_dict, plan_table


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mcp_context.plan", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", help="recipe YAML: model shape, seq_length, TP and PP (flags override)")
    ap.add_argument("--layers", type=int, help="num_layers")
    ap.add_argument("--hidden", type=int, help="hidden_size")
    ap.add_argument("--heads", type=int, help="num_attention_heads")
    ap.add_argument("--kv-heads", type=int, help="num_query_groups (default: heads)")
    ap.add_argument("--head-dim", type=int, help="kv_channels (default: hidden / heads)")
    ap.add_argument("--ffn-hidden", type=int, help="ffn_hidden_size (default: 4 * hidden)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: Llama-3's 128256)")
    ap.add_argument("--seq-len", type=int, help="tokens per sample")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    ap.add_argument("--gpus-per-node", type=int, help="GPUs a node (default: the profile's)")
    ap.add_argument("--tp", type=int, help="tensor_model_parallel_size (default: recipe's, else 1)")
    ap.add_argument("--pp", type=int, help="pipeline_model_parallel_size (default: recipe's, else 1)")
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--profile", default="h100_nvlink_ib",
                    help=f"machine profile: {', '.join(shipped_profiles())} or a YAML path")
    ap.add_argument("--json", metavar="PATH", help="also write the whole plan as JSON ('-' for stdout only)")
    return ap


def _request(args: argparse.Namespace) -> PlanRequest:
    tp, pp, seq = args.tp, args.pp, args.seq_len
    if args.recipe:
        from ..recipes import load_recipe

        cfg = load_recipe(args.recipe).model
        model = ModelShape.from_recipe(cfg)
        tp, pp = tp or cfg.tensor_model_parallel_size, pp or cfg.pipeline_model_parallel_size
        seq = seq or cfg.seq_length
        if args.vocab:
            model = ModelShape.build(model.num_layers, model.hidden_size, model.num_attention_heads,
                                     model.num_query_groups, model.kv_channels, model.ffn_hidden_size, args.vocab,
                                     model.gated_linear_unit)
    else:
        missing = [f"--{n}" for n in ("layers", "hidden", "heads") if getattr(args, n) is None]
        if missing:
            raise ValueError(f"give the model with --recipe FILE or with {', '.join(missing)}")
        model = ModelShape.build(args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim,
                                 args.ffn_hidden, args.vocab)
    if seq is None:
        raise ValueError("give the sequence length with --seq-len (or a recipe's model.seq_length)")
    profile = with_gpus_per_node(load_profile(args.profile), args.gpus_per_node)
    return PlanRequest(model, seq, args.gpus, profile, tp or 1, pp or 1, args.micro_batch_size)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = plan(_request(args))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    data = plan_dict(result)
    if args.json == "-":
        print(json.dumps(data, indent=1))
        return 0
    print(plan_table(result))
    if args.json:
        from ..atomic import write_atomic

        write_atomic(args.json, json.dumps(data, indent=1).encode())
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
