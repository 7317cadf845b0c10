"""Command line of the pretrain entry: check the recipe, then train on every rank.

    torchrun --nproc-per-node 4 -m mcp_context.pretrain --recipe recipes/tiny_cpu.yaml \
        [--run-dir runs/my_run] [section.key=value ...]

(also ``tools/pretrain.py`` and the ``mcp-context-pretrain`` console script, each calling ``main``.)

A bad recipe or a launch that does not fit it prints ``error: ...`` naming the key and exits with
status 2 before any process group starts. At the end rank 0 prints the first and last loss and
where the metrics and the checkpoint are.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

# Not news to a user: megatron-core lacking fused kernels on CPU, and deprecations inside megatron-core
# and torch.distributed.checkpoint that only their maintainers can act on.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed")
warnings.filterwarnings("ignore", message="full scope is deprecated")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|megatron)\.")

from mcp_context.pretrain.launch import check_recipe_for_training, launched_world_size, resolve_run_dir  # noqa: E402
from mcp_context.recipes import RecipeError, load_recipe  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcp_context.pretrain", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=None, help="recipe YAML (default: the embedded tiny CPU recipe)")
    parser.add_argument("--run-dir", default=None,
                        help="directory for metrics.jsonl, recipe.yaml and checkpoints/ (default: the parent of "
                             "checkpoint.save, e.g. runs/tiny_cpu)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    args = parser.parse_args(argv)
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        run_dir = resolve_run_dir(cfg, args.run_dir)
        check_recipe_for_training(cfg, launched_world_size())
    except (RecipeError, FileNotFoundError) as err:
        if os.environ.get("RANK", "0") == "0":  # every rank finds the same error; say it once
            print(f"error: {err}", file=sys.stderr)
        return 2

    from mcp_context.pretrain.loop import train

    result = train(cfg, run_dir, progress=True)
    if os.environ.get("RANK", "0") != "0":
        return 0
    if result.records:
        first, last = result.records[0], result.records[-1]
        print(f"loss {first['loss']:.4f} at step {first['step']} -> {last['loss']:.4f} at step {last['step']}")
        evals = [r for r in result.records if "val_loss" in r]
        if evals:
            print(f"val_loss {evals[0]['val_loss']:.4f} at step {evals[0]['step']} -> "
                  f"{evals[-1]['val_loss']:.4f} at step {evals[-1]['step']}")
    else:
        print(f"nothing to do: the run is already at step {result.first_step} of train.steps={cfg.train.steps}")
    print(f"metrics: {result.metrics_path}")
    print(f"checkpoint: {result.checkpoint if result.checkpoint is not None else 'none (checkpoint.save is null)'}")
    return 0
