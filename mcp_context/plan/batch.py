"""The document lengths of one training step's global batch, read from a recipe's corpus as the pretrain
loop reads them: the recipe's megatron-core ``GPTDataset`` (built with the loop's sample counts, so the
same shuffle), step ``i`` (from 1) holding samples ``[(i - 1) * G, i * G)`` (``pretrain.batches``), each
sample cut into documents at its end-of-document tokens (``data.documents``). Owns no figures: the
balance of those documents is ``balance.py``'s.
"""
from __future__ import annotations

from ..recipes.schema import RecipeConfig


def step_document_lengths(cfg: RecipeConfig, step: int) -> tuple[tuple[tuple[int, ...], ...], int]:
    """``(samples, vocab_size)``: each sample's document lengths (unpadded) at ``step`` (1 is the first), and the
    vocabulary the model is built with (the tokenizer's, padded as the pretrain entry pads it). Tokenises the
    corpus into ``data.cache_dir`` first when it is not there yet."""
    from ..data import build_gpt_datasets, prepare_data
    from ..data.documents import document_offsets

    steps, batch = cfg.train.steps, cfg.train.global_batch_size
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= steps:
        raise ValueError(f"step={step!r} is not a step of the recipe's train.steps={steps}; choose one from 1 to "
                         f"{steps}, or raise train.steps")
    tokenizer, prefixes = prepare_data(cfg)
    train, _ = build_gpt_datasets(cfg, tokenizer, prefixes)
    samples = []
    for index in range((step - 1) * batch, step * batch):
        cu, _ = document_offsets(train[index]["tokens"], tokenizer.eod, 1)
        samples.append(tuple(b - a for a, b in zip(cu, cu[1:])))
    return tuple(samples), cfg.padded_vocab_size(tokenizer.vocab_size)
