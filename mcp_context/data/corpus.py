"""Text sources: the bundled public-domain corpus, user .txt/.jsonl files, and where their tokens go.

Owns reading documents (one string per document) from the bundled Shakespeare scenes or a user file,
and the naming of the files derived from them (tokenised prefix, trained tokenizer) under the
recipe's ``data.cache_dir``: each name carries a key hashing the resolved paths and the bytes of the
corpus and the tokenizer, so a different or edited file never reuses a cache. Imports nothing heavy, so the recipe CLI can use it.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import json
import re
import zlib
from pathlib import Path
from typing import Iterator, Optional, Union

from mcp_context.recipes.checks import split_weights
from mcp_context.recipes.schema import DataConfig, RecipeError

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


class CorpusError(ValueError):
    """A corpus file that cannot be read as documents: the message names the file and line."""


def _binary_lines(path: Path) -> Iterator[bytes]:
    """The lines of ``path`` (gunzipped for .gz) as bytes; a damaged file raises ``CorpusError``."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            yield from f
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise CorpusError(f"{path}: damaged compressed file ({err}); give an intact .gz, or the plain file") from None


def _decode(raw: bytes, path: Path, line_no: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line_no += raw[: err.start].count(b"\n")
        raise CorpusError(
            f"{path}:{line_no}: not UTF-8 text ({err.reason} at byte {err.start} of the line); "
            f"convert the corpus to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _is_jsonl(path: Path) -> bool:
    return path.name.removesuffix(".gz").endswith((".jsonl", ".json"))


def read_documents(path: Union[str, Path], json_key: str = "text") -> Iterator[str]:
    """Yield the documents of a .jsonl file (``json_key`` of each line) or a .txt file (one document).

    Both may be gzip-compressed. Empty documents are skipped. Text that is not UTF-8, a line that
    is not a JSON object, or a record whose text is missing or not a string raises ``CorpusError``
    (missing key: ``KeyError``) naming ``file:line``.
    """
    path = Path(path)
    if not _is_jsonl(path):
        text = _decode(b"".join(_binary_lines(path)), path, 1)
        if text.strip():
            yield text
        return
    for line_no, raw_line in enumerate(_binary_lines(path), 1):
        line = _decode(raw_line, path, line_no).rstrip("\r\n")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorpusError(
                f"{path}:{line_no}: not valid JSON ({err.msg}, column {err.colno}); each line of a .jsonl "
                f'corpus is one JSON object such as {{"{json_key}": "..."}}'
            ) from None
        if not isinstance(record, dict):
            raise CorpusError(
                f"{path}:{line_no}: a JSON {type(record).__name__}, not an object; each line of a .jsonl "
                f'corpus is one JSON object such as {{"{json_key}": "..."}}'
            )
        if json_key not in record:
            raise KeyError(f"{path}:{line_no} has no key {json_key!r} (keys: {sorted(record)}); set data.json_key")
        text = record[json_key]
        if not isinstance(text, str):
            raise CorpusError(
                f"{path}:{line_no}: {json_key!r} holds a JSON {type(text).__name__}, not text; set data.json_key "
                f"to the key that holds each document's text"
            )
        if text.strip():
            yield text


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_") or "x"


def corpus_stem(data: DataConfig) -> str:
    """Short file-name stem of the corpus: the file name without .jsonl/.txt/.gz."""
    name = corpus_path(data).name
    for suffix in (".gz", ".jsonl", ".json", ".txt"):
        name = name.removesuffix(suffix)
    return _slug(name)


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file's bytes; memoised per (path, size, mtime) so one process hashes a corpus once."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def content_digest(path: Path) -> str:
    """sha256 of a file's bytes, or of a directory's files (their relative names and bytes)."""
    if not path.is_dir():
        st = path.stat()
        return _file_digest(str(path), st.st_size, st.st_mtime_ns)
    digest = hashlib.sha256()
    for file in sorted(f for f in path.rglob("*") if f.is_file()):
        digest.update(f"{file.relative_to(path)}\0{content_digest(file)}\0".encode())
    return digest.hexdigest()


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def corpus_key(data: DataConfig) -> str:
    """Identity of the recipe's documents: the resolved corpus path, its bytes and (JSONL) the key
    read from each record. Part of every file name derived from the corpus, so two corpora with one
    file name, or an edited corpus, never share a cache."""
    path = corpus_path(data).resolve()
    return _key(str(path), content_digest(path), data.json_key if _is_jsonl(path) else "")


def tokenizer_trained_from_corpus(data: DataConfig) -> bool:
    """True when the recipe names no tokenizer and its corpus is the user's own: a SentencePiece
    model is then trained from the corpus and cached (``trained_tokenizer_path``)."""
    return data.tokenizer_model is None and data.corpus != "bundled"


def trained_tokenizer_path(data: DataConfig) -> Path:
    """Where a SentencePiece model trained from ``data.corpus`` is cached (keyed by the corpus)."""
    return Path(data.cache_dir) / f"{corpus_stem(data)}_{corpus_key(data)}_sp{data.tokenizer_vocab_size}.model"


def tokenizer_model_path(data: DataConfig) -> str:
    """The tokenizer the recipe uses: ``data.tokenizer_model``, the bundled model for the bundled
    corpus, or the (possibly not yet trained) model cached for the user's corpus."""
    if data.tokenizer_model is not None:
        return data.tokenizer_model
    if data.corpus == "bundled":
        return str(BUNDLED_TOKENIZER)
    return str(trained_tokenizer_path(data))


def tokenizer_key(data: DataConfig) -> str:
    """Identity of the recipe's tokenizer: the resolved path and bytes of its file or directory. A
    model still to be trained from the corpus is named by its path, which carries the corpus key
    and vocabulary size (training is deterministic); a name that is no local path, by the name."""
    name = tokenizer_model_path(data)
    path = Path(name).expanduser()
    if tokenizer_trained_from_corpus(data) or not path.exists():
        return _key(data.tokenizer_type, name)
    path = path.resolve()
    return _key(data.tokenizer_type, str(path), content_digest(path))


def tokenized_prefix(data: DataConfig) -> str:
    """Path prefix (no .bin/.idx) of the corpus tokenised with the recipe's tokenizer:
    ``cache_dir/<corpus>_<tokenizer>_<key>_text_document``, the key hashing ``corpus_key`` and
    ``tokenizer_key`` (the names alone are for people)."""
    tokenizer = _slug(Path(tokenizer_model_path(data)).name.removesuffix(".model"))
    key = _key(corpus_key(data), tokenizer_key(data))
    return str(Path(data.cache_dir) / f"{corpus_stem(data)}_{tokenizer}_{key}_text_document")


def data_prefixes(data: DataConfig) -> list[str]:
    """``data.data_path`` when given, else the tokenised corpus prefix."""
    return list(data.data_path) if data.data_path else [tokenized_prefix(data)]


def split_document_counts(split: str, n_docs: int) -> list[Optional[int]]:
    """Documents in the train, valid and test splits of ``n_docs`` documents, computed as
    megatron-core does (normalised weights, cumulative book-ends, each rounded); None for a split of
    zero weight, which megatron-core skips. A 0 for a split of positive weight is the case its
    dataset builder loops on forever."""
    weights = split_weights(split)
    total = sum(weights)
    ends = [0.0]
    for w in weights:
        ends.append(ends[-1] + w / total)
    return [None if end <= begin else int(round(end * n_docs)) - int(round(begin * n_docs))
            for begin, end in zip(ends[:-1], ends[1:])]


def empty_test_split(split: str, prefix: str, n_docs: int) -> bool:
    """True when the test split of ``prefix`` (``n_docs`` documents) has positive weight but no
    document (callers drop it); an empty train or valid split raises ``RecipeError``. megatron-core's
    dataset builder loops forever on either, so every caller checks here first."""
    for name, count in zip(("train", "valid", "test"), split_document_counts(split, n_docs)):
        if count == 0 and name != "test":
            raise RecipeError(
                f"data.split={split!r} leaves the {name} split of {prefix} ({n_docs} documents) with no document, "
                f"which megatron-core's dataset builder loops on forever; raise the {name} weight, or use a "
                f"corpus with more (shorter) documents"
                + (", or data.split=100,0,0 to train without validation" if name == "valid" else "")
            )
    return split_document_counts(split, n_docs)[2] == 0
