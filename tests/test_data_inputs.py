"""Data inputs that used to go silently wrong or end in a traceback.

- The tokenised cache is keyed by the resolved paths and bytes of corpus and tokenizer: two corpora
  with one file name, or two tokenizers with one file name, never share ``.bin/.idx`` files.
- A corpus that is not valid JSONL or not UTF-8 is an error naming ``file:line``.
- The ``.txt`` example of docs/data.md runs as written (tokenise, then build the datasets).
"""
from __future__ import annotations

import gzip
import json
import re
import shlex
from pathlib import Path

import pytest

from mcp_context.data.corpus import BUNDLED_CORPUS, BUNDLED_TOKENIZER, CorpusError, read_documents
from mcp_context.recipes import load_recipe

spm = pytest.importorskip("sentencepiece")
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

from mcp_context.data import build_gpt_datasets, prepare_data, train_tokenizer  # noqa: E402
from mcp_context.data.__main__ import main as data_cli  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DOCS_DATA = REPO / "docs" / "data.md"


def _scenes(first: int, count: int) -> list[str]:
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f][first : first + count]


def _sequences(prefix: str) -> list[list[int]]:
    indexed = IndexedDataset(prefix)
    return [indexed[i].tolist() for i in range(len(indexed))]


def _write_jsonl(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def test_two_corpora_with_one_file_name_get_two_caches(tmp_path):
    docs_a, docs_b = _scenes(0, 4), _scenes(100, 6)
    cache = tmp_path / "cache"
    results = []
    for name, docs in (("a", docs_a), ("b", docs_b)):
        corpus = _write_jsonl(tmp_path / name / "corpus.jsonl", docs)
        cfg = load_recipe(None, [f"data.cache_dir={cache}", f"data.corpus={corpus}",
                                 f"data.tokenizer_model={BUNDLED_TOKENIZER}"])
        tokenizer, (prefix,) = prepare_data(cfg)
        results.append((prefix, docs, tokenizer))
    (prefix_a, _, tok), (prefix_b, _, _) = results
    assert prefix_a != prefix_b
    for prefix, docs, tokenizer in results:  # each cache holds its own corpus's tokens
        assert _sequences(prefix) == [tokenizer.tokenize(d) + [tokenizer.eod] for d in docs]


def test_two_tokenizers_with_one_file_name_get_two_caches(tmp_path):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", _scenes(10, 5))
    tokenizers = []
    for name, first in (("one", 0), ("two", 150)):  # trained on different text: different ids
        tokenizers.append(train_tokenizer(_scenes(first, 30), tmp_path / name / "sp.model", vocab_size=600))
    prefixes = []
    for model in tokenizers:
        cfg = load_recipe(None, [f"data.cache_dir={tmp_path / 'cache'}", f"data.corpus={corpus}",
                                 f"data.tokenizer_model={model}"])
        tokenizer, (prefix,) = prepare_data(cfg)
        assert _sequences(prefix) == [tokenizer.tokenize(d) + [tokenizer.eod] for d in _scenes(10, 5)]
        prefixes.append(prefix)
    assert prefixes[0] != prefixes[1]
    one, two = (spm.SentencePieceProcessor(model_file=str(m)) for m in tokenizers)
    assert one.encode(_scenes(10, 1)[0]) != two.encode(_scenes(10, 1)[0])  # the shared cache decoded as garbage


def test_force_rebuilds_the_cache(tmp_path):
    cfg = load_recipe(None, [f"data.cache_dir={tmp_path}", f"data.corpus={_write_jsonl(tmp_path / 'c.jsonl', _scenes(0, 3))}",
                             f"data.tokenizer_model={BUNDLED_TOKENIZER}"])
    _, (prefix,) = prepare_data(cfg)
    before = Path(prefix + ".idx").stat().st_mtime_ns
    assert prepare_data(cfg)[1] == [prefix] and Path(prefix + ".idx").stat().st_mtime_ns == before
    assert prepare_data(cfg, force=True)[1] == [prefix] and Path(prefix + ".idx").stat().st_mtime_ns != before


BAD_CORPORA = [
    ("bad.jsonl", b'{"text": "fine"}\n{"text": "cut off\n', r"bad.jsonl:2: not valid JSON \(Unterminated string"),
    ("list.jsonl", b'{"text": "fine"}\n\n["a", "b"]\n', r"list.jsonl:3: a JSON list, not an object"),
    ("number.jsonl", b'{"text": 7}\n', r"number.jsonl:1: 'text' holds a JSON int, not text; set data.json_key"),
    ("latin1.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"latin1.jsonl:2: not UTF-8 text"),
    ("latin1.txt", b"line one\nline two\nna\xefve\n", r"latin1.txt:3: not UTF-8 text"),
    ("cut.jsonl.gz", gzip.compress(b'{"text": "a"}\n' * 200)[:-30], r"cut.jsonl.gz: damaged compressed file"),
]


@pytest.mark.parametrize("name, content, message", BAD_CORPORA, ids=[c[0] for c in BAD_CORPORA])
def test_bad_corpus_names_file_and_line(tmp_path, capsys, name, content, message):
    corpus = tmp_path / name
    corpus.write_bytes(content)
    with pytest.raises(CorpusError, match=message):
        list(read_documents(corpus))
    # The command line gives the same one line, exit status 2, no traceback.
    assert data_cli(["-", f"data.corpus={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
                     f"data.tokenizer_model={BUNDLED_TOKENIZER}"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.startswith("error: ") and "Traceback" not in err


def _documented_commands(section: str) -> list[list[str]]:
    """The ``tools/prepare_data.py`` command lines of a section of docs/data.md, as argv lists."""
    text = DOCS_DATA.read_text()
    block = text.split(f"## {section}", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [shlex.split(line)[2:] for line in block.strip().splitlines()]


def test_documented_text_file_example_tokenises_and_trains(tmp_path):
    """docs/data.md, "Your own text": the .txt line, with its two paths made real, then the datasets
    the training loop builds from the same recipe (a .txt corpus is one document)."""
    (argv,) = [a for a in _documented_commands("Your own text") if any(".txt" in x for x in a)]
    book = tmp_path / "book.txt.gz"
    book.write_bytes(gzip.compress("\n\n".join(_scenes(20, 3)).encode()))
    argv = [str(REPO / a) if a.endswith(".yaml") else
            a.replace("/data/book.txt.gz", str(book)).replace("/models/sp.model", str(BUNDLED_TOKENIZER)) for a in argv]
    argv.append(f"data.cache_dir={tmp_path / 'cache'}")
    assert data_cli(argv) == 0
    cfg = load_recipe(argv[0], argv[1:])
    tokenizer, prefixes = prepare_data(cfg)
    train, valid = build_gpt_datasets(cfg, tokenizer, prefixes)
    assert len(train) >= cfg.train.steps * cfg.train.global_batch_size and valid is None
    assert train[0]["tokens"].shape == (cfg.model.seq_length,)
