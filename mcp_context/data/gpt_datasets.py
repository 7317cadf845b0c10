"""megatron-core GPT datasets for a recipe: ``BlendedMegatronDatasetBuilder`` over ``GPTDatasetConfig``.

Owns the translation of a recipe into ``GPTDatasetConfig`` and the sample counts Megatron-LM would
ask for. Samples are ``model.seq_length`` input tokens (plus one for the shifted labels) packed
across document boundaries, the same packing Megatron-LM trains on. Does not tokenise (see
``mcp_context.data.prepare``) and does not shard samples over CP ranks (the training loop does).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import MegatronTokenizerBase

from mcp_context.data.corpus import data_prefixes, empty_test_split
from mcp_context.recipes.schema import RecipeConfig


def default_sample_counts(cfg: RecipeConfig) -> tuple[int, int, int]:
    """(train, valid, test) samples, as Megatron-LM computes them from steps and eval settings."""
    t = cfg.train
    train = t.steps * t.global_batch_size
    valid = (t.steps // t.eval_interval + 1) * t.eval_iters * t.global_batch_size
    test = t.eval_iters * t.global_batch_size
    return train, valid, test


def gpt_dataset_config(cfg: RecipeConfig, tokenizer: MegatronTokenizerBase, prefixes: Sequence[str]) -> GPTDatasetConfig:
    """The ``GPTDatasetConfig`` of a recipe over the tokenised ``prefixes`` (weighted by size)."""
    d = cfg.data
    return GPTDatasetConfig(
        random_seed=d.seed,
        sequence_length=cfg.model.seq_length,
        blend=(list(prefixes), None),
        split=d.split,
        path_to_cache=str(Path(d.cache_dir) / "index_cache"),
        tokenizer=tokenizer,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=d.create_attention_mask,
    )


def _drop_empty_splits(config: GPTDatasetConfig, prefixes: Sequence[str]) -> None:
    """Refuse a train/valid split that holds no document; skip an empty test split.

    megatron-core 0.16 loops forever when a split with a positive weight rounds to zero documents
    (it keeps adding empty epochs to reach the requested samples), so this runs first. The split
    boundaries stay Megatron-LM's (the test split is dropped from the matrix, not from the weights).
    """
    for prefix in prefixes:
        if empty_test_split(config.split, prefix, len(IndexedDataset(prefix).sequence_lengths)):
            config.split_matrix[2] = None


def build_gpt_datasets(
    cfg: RecipeConfig,
    tokenizer: MegatronTokenizerBase,
    prefixes: Optional[Sequence[str]] = None,
    train_samples: Optional[int] = None,
    valid_samples: Optional[int] = None,
    is_built_on_rank: Optional[Callable[[], bool]] = None,
) -> tuple[Optional[GPTDataset], Optional[GPTDataset]]:
    """Train and valid ``GPTDataset``s of the recipe (a split with no documents gives None).

    ``prefixes`` default to ``data.data_path`` or the tokenised corpus (``prepare_data`` makes it);
    sample counts default to Megatron-LM's (steps * global batch; evaluations * eval_iters * global
    batch). Each sample is a dict with ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (and
    ``attention_mask`` when data.create_attention_mask), each ``model.seq_length`` long. Call on every
    rank when torch.distributed is initialised: rank 0 builds the index cache first, the others wait.
    """
    prefixes = list(prefixes) if prefixes is not None else data_prefixes(cfg.data)
    missing = [p for p in prefixes if not IndexedDataset.exists(p)]
    if missing:
        raise FileNotFoundError(
            f"no tokenised data at {missing}; run `python tools/prepare_data.py RECIPE` "
            f"(or mcp_context.data.prepare_data(cfg)) first"
        )
    train_default, valid_default, test_default = default_sample_counts(cfg)
    sizes = [
        train_default if train_samples is None else train_samples,
        valid_default if valid_samples is None else valid_samples,
        test_default,
    ]
    config = gpt_dataset_config(cfg, tokenizer, prefixes)
    _drop_empty_splits(config, prefixes)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, is_built_on_rank or (lambda: True), config)
    train, valid, _test = builder.build()
    return train, valid
