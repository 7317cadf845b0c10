"""Data pipeline: bundled corpus, SentencePiece tokenizer, megatron-core .bin/.idx files, GPT datasets.

``prepare_data(cfg)`` makes the recipe's tokenizer and tokenised files (once; cached under
``data.cache_dir``); ``build_gpt_datasets(cfg, tokenizer)`` returns megatron-core ``GPTDataset``s
whose samples are ``model.seq_length`` tokens packed across documents. Names that need megatron-core
are imported on first use (importing megatron-core takes seconds), so ``mcp_context.data.corpus``
stays cheap for the recipe CLI.
"""
from importlib import import_module

_LAZY = {
    "build_gpt_datasets": "mcp_context.data.gpt_datasets",
    "prepare_data": "mcp_context.data.prepare",
    "write_indexed_dataset": "mcp_context.data.prepare",
    "load_tokenizer": "mcp_context.data.tokenizer",
    "train_tokenizer": "mcp_context.data.tokenizer",
    "SentencePieceTokenizer": "mcp_context.data.tokenizer",
    "HuggingFaceTokenizer": "mcp_context.data.tokenizer",
    "read_documents": "mcp_context.data.corpus",
    "CorpusError": "mcp_context.data.corpus",
    "BUNDLED_CORPUS": "mcp_context.data.corpus",
    "BUNDLED_TOKENIZER": "mcp_context.data.corpus",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mcp_context.data' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
