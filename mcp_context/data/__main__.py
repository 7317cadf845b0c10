"""Tokenise a recipe's corpus into megatron-core .bin/.idx files (and train its tokenizer if needed).

    python -m mcp_context.data recipes/tiny_cpu.yaml [section.key=value ...] [--force]
    python -m mcp_context.data - data.corpus=my_docs.jsonl data.json_key=content

(``tools/prepare_data.py`` runs the same from a source checkout.)

Prints the tokenizer, the data prefix, and document/token counts. Run once before training; the
result is cached under data.cache_dir and reused.
"""
from __future__ import annotations

import argparse
import sys
import warnings

# megatron-core (imported by the validators) warns once per fused kernel it lacks; not news on CPU.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed")

from mcp_context.data.corpus import CorpusError  # noqa: E402
from mcp_context.megatron_import import import_megatron_core  # noqa: E402
from mcp_context.recipes import RecipeError, load_recipe, validate_recipe  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcp_context.data", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="recipe YAML file, or - for the embedded tiny CPU default")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.corpus=docs.jsonl")
    parser.add_argument("--force", action="store_true", help="re-tokenise (and retrain a tokenizer trained from the corpus) even if the files exist")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_recipe(None if args.recipe == "-" else args.recipe, args.overrides)
        validate_recipe(cfg)
        import_megatron_core()  # before anything of megatron-core: its fusions compile at first call
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        from mcp_context.data import prepare_data

        tokenizer, prefixes = prepare_data(cfg, force=args.force)
    except (RecipeError, FileNotFoundError, KeyError, CorpusError) as err:
        message = err.args[0] if isinstance(err, KeyError) else err  # str(KeyError) would add quotes
        print(f"error: {message}", file=sys.stderr)
        return 2
    print(f"tokenizer: {tokenizer.path} ({tokenizer.vocab_size} pieces, end-of-document id {tokenizer.eod})")
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)  # keep it alive: sequence_lengths is a view of its mmap
        lengths = dataset.sequence_lengths
        print(f"data: {prefix} ({len(lengths)} documents, {int(lengths.sum())} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
