"""Command line for recipes: show one resolved, or validate it.

    python -m mcp_context.recipes show FILE [section.key=value ...]
    python -m mcp_context.recipes validate FILE [--world-size N] [section.key=value ...]

FILE may be ``-`` for the embedded default (the tiny CPU recipe). A bad recipe prints the error,
naming the key, and exits with status 2. Neither command imports megatron-core (seconds), so both
answer in well under 2 s. A recipe's Megatron-LM command: ``python -m mcp_context.megatron_lm FILE``.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import yaml

from mcp_context.recipes import RecipeError, load_recipe, validate_recipe


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcp_context.recipes", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["show", "validate"])
    parser.add_argument("recipe", help="recipe YAML file, or - for the embedded tiny CPU default")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.context_parallel_size=8")
    parser.add_argument("--world-size", type=int, default=None, help="ranks to check the layout against")
    args = parser.parse_intermixed_args(argv)
    path = None if args.recipe == "-" else args.recipe
    try:
        cfg = load_recipe(path, args.overrides)
        validate_recipe(cfg, world_size=args.world_size)
        if args.command == "show":
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None), end="")
        else:
            m = cfg.model
            print(
                f"OK {cfg.name}: TP{m.tensor_model_parallel_size} PP{m.pipeline_model_parallel_size} "
                f"CP{m.context_parallel_size} ({m.cp_comm_type}, levels {m.hierarchical_context_parallel_sizes}) "
                f"seq_length {m.seq_length}, world size {args.world_size or cfg.train.world_size}"
            )
    except (RecipeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
