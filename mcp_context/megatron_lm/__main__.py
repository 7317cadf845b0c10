"""Print the Megatron-LM ``pretrain_gpt.py`` command of a recipe, after the step that prepares its data.

    python -m mcp_context.megatron_lm FILE [section.key=value ...]

FILE may be ``-`` for the embedded default (the tiny CPU recipe). A recipe Megatron-LM cannot run as
written prints the error, naming the key, and exits with status 2. This command composes the recipes
and the Megatron-LM translation, so it stands on the entry points' floor with the translation, not
on the recipes' floor (``tests/test_layering.py``).
"""
from __future__ import annotations

import argparse
import shlex
import sys
import warnings
from typing import Optional, Sequence

# megatron-core (imported by the validators) warns once per fused kernel it lacks; not news on CPU.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed")

from mcp_context.megatron_lm import format_megatron_command  # noqa: E402
from mcp_context.recipes import RecipeError, load_recipe, validate_recipe  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcp_context.megatron_lm", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="recipe YAML file, or - for the embedded tiny CPU default")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.context_parallel_size=8")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_recipe(None if args.recipe == "-" else args.recipe, args.overrides)
        validate_recipe(cfg)
        hint = "python tools/prepare_data.py " + " ".join(shlex.quote(a) for a in [args.recipe, *args.overrides])
        print(format_megatron_command(cfg, prepare_hint=hint))
    except (RecipeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
