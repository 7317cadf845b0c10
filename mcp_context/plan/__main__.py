"""``python -m mcp_context.plan``: plan context parallelism for a model, a sequence and a machine;
``python -m mcp_context.plan balance``: a training step's per-rank work under dynamic CP and a fixed CP size.

Examples::

    python -m mcp_context.plan --recipe recipes/llama3_70b_1m_hcp.yaml --gpus 64 --tp 8 --pp 1
    python -m mcp_context.plan --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn-hidden 28672 \\
        --seq-len 1048576 --gpus 64 --tp 8 --profile h200_nvlink_ib --json plan.json
    python -m mcp_context.plan balance --recipe recipes/tiny_dynamic_cp_cpu.yaml --cp 4
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable, NoReturn, Optional, Sequence

from ..recipes.schema import ModelConfig
from .dryrun import check_dry_run_fits
from .planner import PlanRequest, plan, rank_shape, with_gpus_per_node
from .profiles import load_profile, shipped_profiles
from .report import plan_dict, plan_table


class _OneLineParser(argparse.ArgumentParser):
    """Argument errors as one line (``error: ...``, exit 2), like the planner's own errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


# Upper bound of every integer flag, and why: far beyond any model, cluster or context, and small
# enough that the figures derived from them (tensor sizes of the dry run, bytes, FLOPs) stay exact.
MAX_VALUES: dict[str, tuple[int, str]] = {
    "--layers": (2**16, "2**16 layers"),
    "--hidden": (2**20, "2**20"),
    "--heads": (2**16, "2**16 heads"),
    "--kv-heads": (2**16, "2**16 heads"),
    "--head-dim": (2**16, "2**16"),
    "--ffn-hidden": (2**24, "2**24"),
    "--vocab": (2**31 - 1, "2**31 - 1, the int32 token ids of megatron-core's datasets"),
    "--seq-len": (2**26, "2**26 tokens, 64x a 1M context; the dry run's time and memory grow with the sequence: "
                         "122 s and 1.9 GB there"),
    "--gpus": (2**24, "2**24 GPUs"),
    "--gpus-per-node": (2**10, "2**10"),
    "--tp": (2**24, "2**24"),
    "--pp": (2**24, "2**24"),
    "--micro-batch-size": (2**20, "2**20"),
    "--cp-sizes": (2**24, "2**24"),
    "--jobs": (2**10, "2**10 processes"),
    "--cp": (2**24, "2**24"),
    "--budget": (2**26, "2**26 tokens, as --seq-len"),
}


def _bounded_int(flag: str):
    """argparse type for ``flag``: an integer from 1 to its ``MAX_VALUES`` bound (argparse puts the
    flag's name before the message)."""
    hi, why = MAX_VALUES[flag]

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
        if value > hi:
            raise argparse.ArgumentTypeError(f"{text!r} is above the largest value planned for, {hi} ({why})")
        return value

    return parse


# the model-shape flags (integers >= 1) -> help
_MODEL_FLAGS = {"--layers": "num_layers", "--hidden": "hidden_size", "--heads": "num_attention_heads",
                "--kv-heads": "num_query_groups (default: heads)",
                "--head-dim": "kv_channels (default: hidden / heads)",
                "--ffn-hidden": "ffn_hidden_size (default: 4 * hidden)"}


def _jobs(text: str) -> Optional[int]:
    """--jobs: ``auto`` (None: ``planner.auto_jobs`` decides) or an integer from 1 to its bound."""
    if text == "auto":
        return None
    try:
        return _bounded_int("--jobs")(text)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{err} (or auto)") from None


def window_pair(text: str) -> tuple[int, int]:
    """``LEFT,RIGHT`` as two ints, an argparse ``type`` (the range is the mask's own check, with its message);
    ``tools/step_ops.py --window`` takes it too."""
    parts = text.split(",")
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LEFT,RIGHT (two integers, -1 for unbounded), "
                                         f"e.g. 4095,0") from None
    return left, right


def _parser() -> argparse.ArgumentParser:
    ap = _OneLineParser(prog="python -m mcp_context.plan", description=__doc__.split(";")[0],
                        epilog="python -m mcp_context.plan balance --help: a step's per-rank work, dynamic vs fixed CP",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", help="recipe YAML: model shape, seq_length, TP and PP (--seq-len, --vocab, --tp and "
                                     "--pp override it)")
    for flag, what in _MODEL_FLAGS.items():
        ap.add_argument(flag, type=_bounded_int(flag), help=what)
    ap.add_argument("--vocab", type=_bounded_int("--vocab"), help="vocabulary size (default: Llama-3's 128256)")
    ap.add_argument("--seq-len", type=_bounded_int("--seq-len"), help="tokens per sample")
    ap.add_argument("--gpus", type=_bounded_int("--gpus"), required=True, help="GPUs in the job")
    ap.add_argument("--gpus-per-node", type=_bounded_int("--gpus-per-node"), help="GPUs a node (default: the profile's)")
    ap.add_argument("--tp", type=_bounded_int("--tp"), help="tensor_model_parallel_size (default: recipe's, else 1)")
    ap.add_argument("--pp", type=_bounded_int("--pp"), help="pipeline_model_parallel_size (default: recipe's, else 1)")
    ap.add_argument("--micro-batch-size", type=_bounded_int("--micro-batch-size"), default=1)
    ap.add_argument("--window-size", type=window_pair, metavar="LEFT,RIGHT",
                    help="sliding window of the planned attention layer, Megatron-LM's form (e.g. 4095,0; -1 is "
                         "unbounded; -1,-1 plans a layer without one); default: the recipe's model.window_size")
    ap.add_argument("--cp-sizes", type=_bounded_int("--cp-sizes"), nargs="+", metavar="CP",
                    help="evaluate only these context_parallel_sizes (default: every divisor of gpus / (tp * pp))")
    ap.add_argument("--profile", default="h100_nvlink_ib",
                    help=f"machine profile: {', '.join(shipped_profiles())} or a YAML path")
    ap.add_argument("--json", metavar="PATH", help="also write the whole plan as JSON ('-' for stdout only)")
    ap.add_argument("--jobs", type=_jobs, default=None, metavar="N|auto",
                    help="evaluate the candidates in this many worker processes, each importing its own torch; "
                         "auto (default): the usable CPUs, at most 8, when a CP size of 16 or more is planned, else "
                         "1 (planner.auto_jobs)")
    ap.add_argument("--no-progress", action="store_true",
                    help="hide the progress over the candidates (on stderr: a bar on a terminal, else a line a minute)")
    ap.add_argument("--dry-run-all", action="store_true",
                    help="dry-run every candidate, also those whose host issue time alone is above "
                         "planner.SKIP_ABOVE times the fastest layout's (listed as not dry-run otherwise)")
    return ap


def _request(args: argparse.Namespace) -> PlanRequest:
    tp, pp, seq = args.tp, args.pp, args.seq_len
    if args.json not in (None, "-") and not Path(args.json).parent.is_dir():
        raise ValueError(f"--json={args.json}: directory {Path(args.json).parent} does not exist; create it first "
                         f"or give a path in an existing directory")
    if args.recipe:
        from ..recipes import load_recipe

        given = [flag for flag in _MODEL_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with --recipe={args.recipe}, which gives the "
                             f"model shape; drop them, or drop --recipe and give the shape with flags")
        if not Path(args.recipe).is_file():
            raise ValueError(f"--recipe={args.recipe}: no such file; give the path of a recipe YAML "
                             f"(e.g. recipes/llama3_8b_128k_hcp.yaml)")
        model = load_recipe(args.recipe).model
        tp, pp = tp or model.tensor_model_parallel_size, pp or model.pipeline_model_parallel_size
        seq = seq or model.seq_length
        if args.vocab:
            model = dataclasses.replace(model, vocab_size=args.vocab)
    else:
        missing = [f"--{n}" for n in ("layers", "hidden", "heads") if getattr(args, n) is None]
        if missing:
            raise ValueError(f"give the model with --recipe FILE or with {', '.join(missing)}")
        model = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            num_query_groups=args.kv_heads, kv_channels=args.head_dim,
                            ffn_hidden_size=args.ffn_hidden, vocab_size=args.vocab)
    if seq is None:
        raise ValueError("give the sequence length with --seq-len (or a recipe's model.seq_length)")
    seq_max, why = MAX_VALUES["--seq-len"]
    if seq > seq_max:  # a recipe's model.seq_length is bounded here too
        raise ValueError(f"model.seq_length={seq} of --recipe={args.recipe} is above the largest sequence planned "
                         f"for, {seq_max} ({why}); give --seq-len")
    profile = with_gpus_per_node(load_profile(args.profile), args.gpus_per_node)
    request = PlanRequest(model, seq, args.gpus, profile, tp or 1, pp or 1, args.micro_batch_size,
                          cp_sizes=tuple(args.cp_sizes) if args.cp_sizes else None, window_size=args.window_size)
    check_dry_run_fits(rank_shape(request))
    return request


def _balance_parser() -> argparse.ArgumentParser:
    ap = _OneLineParser(prog="python -m mcp_context.plan balance",
                        description="Per-rank attention FLOPs, linear FLOPs and CP bytes of one training step's global "
                                    "batch from the recipe's corpus, under dynamic CP (our plan) and under a fixed CP "
                                    "size; max, mean and max/mean over the data x context parallel ranks "
                                    "(train.world_size / (TP * PP)).")
    ap.set_defaults(command="balance")
    ap.add_argument("--recipe", required=True, help="recipe YAML: model, corpus, seq_length, global batch, world size")
    ap.add_argument("--cp", type=_bounded_int("--cp"), help="the fixed context_parallel_size compared "
                                                                   "(default: the recipe's)")
    ap.add_argument("--budget", type=_bounded_int("--budget"),
                    help="dynamic CP's tokens a rank (default: the recipe's model.max_seqlen_per_dp_cp_rank)")
    ap.add_argument("--step", type=int, default=1, help="the training step whose global batch is read (from 1)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures, per rank, as JSON ('-' for stdout only)")
    ap.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. model.seq_length=8192")
    return ap


def _balance(args: argparse.Namespace):
    """The step's ``Balance`` from the recipe (its corpus tokenised first if need be)."""
    import torch

    from ..recipes import load_recipe
    from .balance import BalanceRequest, work_balance
    from .batch import step_document_lengths

    if args.json not in (None, "-") and not Path(args.json).parent.is_dir():
        raise ValueError(f"--json={args.json}: directory {Path(args.json).parent} does not exist; create it first "
                         f"or give a path in an existing directory")
    cfg = load_recipe(args.recipe, args.overrides)
    m = cfg.model
    budget = args.budget or m.max_seqlen_per_dp_cp_rank
    if budget is None:
        raise ValueError(f"--recipe={args.recipe} sets no model.max_seqlen_per_dp_cp_rank; give dynamic CP's tokens "
                         f"a rank with --budget")
    if cfg.train.world_size % (m.tensor_model_parallel_size * m.pipeline_model_parallel_size):
        raise ValueError(f"train.world_size={cfg.train.world_size} is not a multiple of TP x PP = "
                         f"{m.tensor_model_parallel_size} x {m.pipeline_model_parallel_size}; fix the recipe")
    samples, vocab = step_document_lengths(cfg, args.step)
    levels = m.hierarchical_context_parallel_sizes
    request = BalanceRequest(samples, cfg.train.world_size // (m.tensor_model_parallel_size *
                                                               m.pipeline_model_parallel_size),
                             budget, args.cp or m.context_parallel_size, dataclasses.replace(m, vocab_size=vocab),
                             m.cp_comm_type, levels[0] if levels else None, getattr(torch, m.params_dtype))
    return work_balance(request)


def _emit(data: dict, table: Callable[[], str], json_path: Optional[str]) -> int:
    """What both commands print: the JSON alone on stdout for ``--json -``; else the table, and the JSON
    written (atomically) to ``--json PATH`` when given."""
    if json_path == "-":
        print(json.dumps(data, indent=1))
        return 0
    print(table())
    if json_path:
        from ..atomic import write_atomic

        write_atomic(json_path, json.dumps(data, indent=1).encode())
        print(f"\nwrote {json_path}")
    return 0


def balance_main(argv: Sequence[str]) -> int:
    args = _balance_parser().parse_intermixed_args(argv)
    from .report import balance_dict, balance_table

    try:
        result = _balance(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return _emit(balance_dict(result), lambda: balance_table(result, f"step {args.step} of {args.recipe}"), args.json)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["balance"]:
        return balance_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        result = plan(_request(args), progress=False if args.no_progress else None, jobs=args.jobs,
                      dry_run_all=args.dry_run_all)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return _emit(plan_dict(result), lambda: plan_table(result), args.json)


if __name__ == "__main__":
    sys.exit(main())
