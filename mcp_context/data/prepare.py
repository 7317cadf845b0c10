"""From a recipe's data section to files on disk: the tokenizer and the tokenised corpus (.bin/.idx).

Owns the tokenisation of documents into megatron-core's indexed dataset format (the one Megatron-LM's
``tools/preprocess_data.py`` writes: one sequence per document, end-of-document token appended) and
the caching of it under ``data.cache_dir``. Run it once before training: ``tools/prepare_data.py``,
or ``prepare_data(cfg)`` on one rank.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.core.tokenizers import MegatronTokenizerBase

from mcp_context.data.corpus import corpus_path, read_documents, tokenized_prefix
from mcp_context.data.tokenizer import load_tokenizer
from mcp_context.recipes.schema import RecipeConfig, RecipeError


def write_indexed_dataset(documents: Iterable[str], tokenizer: MegatronTokenizerBase, prefix: str) -> int:
    """Tokenise ``documents`` into ``prefix.bin`` / ``prefix.idx``; return the number of tokens.

    Each document becomes one sequence ending in ``tokenizer.eod``. Token ids are stored in the
    smallest dtype that holds the vocabulary (uint16 below 65500). Both files are written under
    temporary names and renamed, the index last, so a present ``.idx`` means a complete dataset.
    """
    bin_path, idx_path = get_bin_path(prefix), get_idx_path(prefix)
    Path(bin_path).parent.mkdir(parents=True, exist_ok=True)
    bin_tmp, idx_tmp = f"{bin_path}.tmp{os.getpid()}", f"{idx_path}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(bin_tmp, dtype=DType.optimal_dtype(tokenizer.vocab_size))
    n_docs = n_tokens = 0
    try:
        for text in documents:
            ids = list(tokenizer.tokenize(text)) + [tokenizer.eod]
            builder.add_document(ids, [len(ids)])
            n_docs += 1
            n_tokens += len(ids)
        builder.finalize(idx_tmp)
        if n_docs == 0:
            raise ValueError(f"no documents to tokenise for {prefix}: the corpus is empty")
        os.replace(bin_tmp, bin_path)
        os.replace(idx_tmp, idx_path)
    finally:
        for tmp in (bin_tmp, idx_tmp):
            if os.path.exists(tmp):
                os.unlink(tmp)
    return n_tokens


def prepare_data(cfg: RecipeConfig, force: bool = False) -> tuple[MegatronTokenizerBase, list[str]]:
    """Make the recipe's tokenizer and tokenised data; return ``(tokenizer, data prefixes)``.

    With ``data.data_path`` the given prefixes are checked and used as they are; otherwise the corpus
    is tokenised into ``data.cache_dir`` unless a complete copy is already there. The cache is keyed
    by the resolved paths and contents of corpus and tokenizer (``tokenized_prefix``), so an edited
    corpus is tokenised afresh; ``force`` rebuilds anyway (and retrains a tokenizer trained from the
    corpus).
    """
    data = cfg.data
    tokenizer = load_tokenizer(data, retrain=force)
    if cfg.padded_vocab_size(tokenizer.vocab_size) < tokenizer.vocab_size:
        raise RecipeError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); set model.vocab_size to null or at least {tokenizer.vocab_size}"
        )
    if data.data_path:
        missing = [p for p in data.data_path if not IndexedDataset.exists(p)]
        if missing:
            raise FileNotFoundError(
                f"data.data_path has prefixes without .bin/.idx files: {missing}; tokenise them first "
                f"or set data.data_path to null to use data.corpus"
            )
        return tokenizer, list(data.data_path)
    prefix = tokenized_prefix(data)
    if force or not IndexedDataset.exists(prefix):
        write_indexed_dataset(read_documents(corpus_path(data), data.json_key), tokenizer, prefix)
    return tokenizer, [prefix]
