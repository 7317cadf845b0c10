"""Text sources: the bundled public-domain corpus, user .txt/.jsonl files, and where their tokens go.

Owns reading documents (one string per document) from the bundled Shakespeare scenes or a user file,
and the naming of the files derived from them (tokenised prefix, trained tokenizer) under the
recipe's ``data.cache_dir``. Imports nothing heavy, so the recipe CLI can use it.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import IO, TYPE_CHECKING, Iterator, Union

if TYPE_CHECKING:  # the recipe package imports this module: no import cycle at run time
    from mcp_context.recipes.config import DataConfig

BUNDLED_DIR = Path(__file__).resolve().parent / "corpus"
BUNDLED_CORPUS = BUNDLED_DIR / "shakespeare_scenes.jsonl.gz"
"""236 scenes of 12 Shakespeare plays, one JSON record ({"play", "text"}) per line; see README.md there."""
BUNDLED_TOKENIZER = BUNDLED_DIR / "shakespeare_bpe4k.model"
"""SentencePiece BPE model (4096 pieces, lossless on the corpus) trained by ``train_tokenizer``."""


def corpus_path(data: DataConfig) -> Path:
    """The text file that ``data.corpus`` names (``bundled`` is the shipped corpus)."""
    path = BUNDLED_CORPUS if data.corpus == "bundled" else Path(data.corpus).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"data.corpus={data.corpus!r}: no such file {path}; give a .txt or .jsonl(.gz) file, or 'bundled'"
        )
    return path


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def _is_jsonl(path: Path) -> bool:
    return path.name.removesuffix(".gz").endswith((".jsonl", ".json"))


def read_documents(path: Union[str, Path], json_key: str = "text") -> Iterator[str]:
    """Yield the documents of a .jsonl file (``json_key`` of each line) or a .txt file (one document).

    Both may be gzip-compressed. Empty documents are skipped.
    """
    path = Path(path)
    with _open_text(path) as f:
        if not _is_jsonl(path):
            text = f.read()
            if text.strip():
                yield text
            return
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if json_key not in record:
                raise KeyError(
                    f"{path}:{line_no} has no key {json_key!r} (keys: {sorted(record)}); set data.json_key"
                )
            if record[json_key].strip():
                yield record[json_key]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_") or "x"


def corpus_stem(data: DataConfig) -> str:
    """Short file-name stem of the corpus: the file name without .jsonl/.txt/.gz."""
    name = corpus_path(data).name
    for suffix in (".gz", ".jsonl", ".json", ".txt"):
        name = name.removesuffix(suffix)
    return _slug(name)


def trained_tokenizer_path(data: DataConfig) -> Path:
    """Where a SentencePiece model trained from ``data.corpus`` is cached."""
    return Path(data.cache_dir) / f"{corpus_stem(data)}_sp{data.tokenizer_vocab_size}.model"


def tokenizer_model_path(data: DataConfig) -> str:
    """The tokenizer the recipe uses: ``data.tokenizer_model``, the bundled model for the bundled
    corpus, or the (possibly not yet trained) model cached for the user's corpus."""
    if data.tokenizer_model is not None:
        return data.tokenizer_model
    if data.corpus == "bundled":
        return str(BUNDLED_TOKENIZER)
    return str(trained_tokenizer_path(data))


def tokenized_prefix(data: DataConfig) -> str:
    """Path prefix (no .bin/.idx) of the corpus tokenised with the recipe's tokenizer."""
    tokenizer = _slug(Path(tokenizer_model_path(data)).name.removesuffix(".model"))
    return str(Path(data.cache_dir) / f"{corpus_stem(data)}_{tokenizer}_text_document")


def data_prefixes(data: DataConfig) -> list[str]:
    """``data.data_path`` when given, else the tokenised corpus prefix."""
    return list(data.data_path) if data.data_path else [tokenized_prefix(data)]
