"""Tokenizers for megatron-core datasets: SentencePiece training, and adapters to ``MegatronTokenizerBase``.

megatron-core's ``GPTDataset`` needs a tokenizer object with ``vocab_size``, ``eod`` and ``pad`` and a
``unique_identifiers`` mapping (it goes into the dataset cache key). ``SentencePieceTokenizer`` wraps a
SentencePiece ``.model``; ``HuggingFaceTokenizer`` wraps a local Hugging Face tokenizer directory
(optional ``transformers`` dependency, imported on use). ``load_tokenizer`` picks one from a recipe's
data section, training a SentencePiece model from the corpus first when none is given.
"""
from __future__ import annotations

import io
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Sequence, Union

from megatron.core.tokenizers import MegatronTokenizerBase

from mcp_context.data.corpus import corpus_path, read_documents, tokenizer_model_path, tokenizer_trained_from_corpus
from mcp_context.atomic import write_atomic
from mcp_context.recipes.schema import DataConfig

# Special ids of trained models: unk 0, bos 1, eos 2 (also the end-of-document token), pad 3.
_UNK_ID, _BOS_ID, _EOS_ID, _PAD_ID = 0, 1, 2, 3


def train_tokenizer(documents: Iterable[str], output: Union[str, Path], vocab_size: int = 4096) -> Path:
    """Train a lossless SentencePiece BPE model on ``documents`` and write it to ``output``.

    Lossless: no normalisation, whitespace kept, newline is a piece and unknown characters fall back
    to bytes, so ``decode(encode(text)) == text``. Paragraphs (blank-line separated) are the training
    sentences. Single-threaded, so the same corpus gives the same model. The file is written under a
    temporary name and renamed.
    """
    import sentencepiece as spm

    paragraphs = [p + "\n\n" for doc in documents for p in doc.split("\n\n") if p.strip()]
    if not paragraphs:
        raise ValueError("train_tokenizer got no text: the corpus has no non-empty documents")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(paragraphs),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["\n"],
        unk_id=_UNK_ID,
        bos_id=_BOS_ID,
        eos_id=_EOS_ID,
        pad_id=_PAD_ID,
        max_sentence_length=1 << 16,
        num_threads=1,
        minloglevel=2,
    )
    return write_atomic(output, model.getvalue())


class SentencePieceTokenizer(MegatronTokenizerBase):
    """A SentencePiece ``.model`` as a megatron-core tokenizer; the end-of-document token is EOS."""

    def __init__(self, model_path: Union[str, Path]):
        import sentencepiece as spm

        model_path = Path(model_path)
        if not model_path.is_file():
            raise FileNotFoundError(f"SentencePiece model {model_path} does not exist (data.tokenizer_model)")
        super().__init__(str(model_path), {"library": "sentencepiece"})
        self._sp = spm.SentencePieceProcessor(model_file=str(model_path))
        if self._sp.eos_id() < 0:
            raise ValueError(f"{model_path} has no EOS piece; megatron-core needs one as end-of-document")
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", [str(model_path.resolve())])]
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self._sp.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size())}

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        if self._sp.pad_id() < 0:
            raise AttributeError("this SentencePiece model has no pad piece")
        return self._sp.pad_id()

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("pretraining tokenizers here have no chat template")


class HuggingFaceTokenizer(MegatronTokenizerBase):
    """A local Hugging Face tokenizer (directory with tokenizer.json) as a megatron-core tokenizer."""

    def __init__(self, path: Union[str, Path]):
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ImportError(
                "data.tokenizer_type='HuggingFaceTokenizer' needs transformers: pip install 'mcp_context[hf]'"
            ) from err
        super().__init__(str(path), {"library": "huggingface"})
        self._tok = AutoTokenizer.from_pretrained(str(path))
        if self._tok.eos_token_id is None:
            raise ValueError(f"Hugging Face tokenizer {path} has no EOS token; megatron-core needs one as end-of-document")
        self.unique_identifiers = OrderedDict([("class", type(self).__name__), ("tokenizer_path", [str(path)])])

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        return self._tok.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab()

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self._tok.get_vocab().items()}

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        return self._tok.eos_token_id

    @property
    def eos(self) -> int:
        return self._tok.eos_token_id

    @property
    def pad(self) -> int:
        if self._tok.pad_token_id is None:
            raise AttributeError("this Hugging Face tokenizer has no pad token")
        return self._tok.pad_token_id

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("pretraining tokenizers here have no chat template")


def load_tokenizer(data: DataConfig, retrain: bool = False) -> MegatronTokenizerBase:
    """The recipe's tokenizer; trains and caches a SentencePiece model from the corpus when the
    recipe names none and the corpus is the user's own (again if ``retrain``)."""
    path = tokenizer_model_path(data)
    if data.tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(path)
    if tokenizer_trained_from_corpus(data) and (retrain or not Path(path).is_file()):
        train_tokenizer(read_documents(corpus_path(data), data.json_key), path, data.tokenizer_vocab_size)
    return SentencePieceTokenizer(path)
