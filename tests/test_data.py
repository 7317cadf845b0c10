"""Data pipeline: corpus -> SentencePiece tokenizer -> megatron-core .bin/.idx -> GPTDataset samples.

References are independent of the code under test: the corpus text itself (decoded samples must be
substrings of it), the token stream a direct SentencePiece encode gives, and megatron-core's own
``IndexedDataset`` reader for the files we write.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mcp_context.data.corpus import BUNDLED_CORPUS, BUNDLED_TOKENIZER, read_documents
from mcp_context.recipes import RecipeError, load_recipe

spm = pytest.importorskip("sentencepiece")
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

from mcp_context.data import build_gpt_datasets, prepare_data  # noqa: E402
from mcp_context.data.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer  # noqa: E402


def _sequences(prefix: str) -> list[list[int]]:
    """All sequences of ``prefix`` through megatron-core's reader (copied out while the reader lives:
    its arrays are views of a memory map that closes with it)."""
    indexed = IndexedDataset(prefix)
    return [indexed[i].tolist() for i in range(len(indexed))]


def _bundled_texts() -> list[str]:
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def _check_samples(dataset, tokenizer, corpus_text: str, seq_length: int, n: int = 6) -> None:
    """Each sample: seq_length tokens + shifted labels (seq_length + 1 tokens drawn in all), whose
    pieces between end-of-document tokens decode to text found verbatim in the corpus."""
    for idx in np.linspace(0, len(dataset) - 1, n).astype(int):
        sample = dataset[int(idx)]
        tokens, labels = sample["tokens"], sample["labels"]
        assert tokens.shape == labels.shape == (seq_length,)
        assert torch.equal(labels[:-1], tokens[1:])  # labels are the next tokens
        assert torch.equal(sample["position_ids"], torch.arange(seq_length))
        assert torch.all(sample["loss_mask"] == 1.0)
        assert "attention_mask" not in sample  # never materialise [s, s] masks for long context
        drawn = torch.cat([tokens, labels[-1:]]).tolist()  # the seq_length + 1 tokens of the sample
        pieces, current = [], []
        for t in drawn:
            if t == tokenizer.eod:
                pieces.append(current)
                current = []
            else:
                current.append(t)
        pieces.append(current)
        texts = [tokenizer.detokenize(p) for p in pieces if len(p) > 2]
        assert texts, "a sample holds text"
        for text in texts:
            assert text in corpus_text, f"decoded sample text not in the corpus: {text[:80]!r}"


def test_bundled_tokenizer_is_lossless_and_has_megatron_special_ids():
    tok = SentencePieceTokenizer(BUNDLED_TOKENIZER)
    texts = _bundled_texts()
    assert tok.vocab_size == 4096 and (tok.eod, tok.eos, tok.pad, tok.bos) == (2, 2, 3, 1)
    assert len(texts) == 236
    for text in texts[::10]:
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.unique_identifiers["class"] == "SentencePieceTokenizer"
    assert BUNDLED_TOKENIZER.stat().st_size < 1 << 20


def test_bundled_corpus_to_gpt_dataset(tmp_path):
    cfg = load_recipe(None, [f"data.cache_dir={tmp_path}", "model.seq_length=128"])
    tokenizer, prefixes = prepare_data(cfg)
    texts = _bundled_texts()
    reference_sp = spm.SentencePieceProcessor(model_file=str(BUNDLED_TOKENIZER))

    # The .bin/.idx files, read back by megatron-core's reader: one sequence per document, in order,
    # equal to a direct SentencePiece encode plus the end-of-document token.
    (prefix,) = prefixes
    sequences = _sequences(prefix)
    assert len(sequences) == len(texts) == 236
    for i in (0, 1, 117, 235):
        assert sequences[i] == reference_sp.encode(texts[i]) + [tokenizer.eod]
    indexed = IndexedDataset(prefix)
    assert indexed[0].dtype == np.uint16  # 4096-piece vocabulary fits 16 bits
    del indexed

    train, valid = build_gpt_datasets(cfg, tokenizer, prefixes)
    assert len(train) >= cfg.train.steps * cfg.train.global_batch_size
    assert valid is not None and len(valid) > 0
    corpus_text = "\n".join(texts)
    _check_samples(train, tokenizer, corpus_text, 128)
    _check_samples(valid, tokenizer, corpus_text, 128)

    # Cached: a second prepare does not rewrite the files.
    mtime = Path(prefix + ".bin").stat().st_mtime_ns
    assert prepare_data(cfg)[1] == prefixes and Path(prefix + ".bin").stat().st_mtime_ns == mtime


def _user_documents() -> list[str]:
    """Documents unlike the bundled corpus's JSON: paragraphs of one play, some with non-ASCII text."""
    paragraphs = [p for p in _bundled_texts()[40].split("\n\n") if p.strip()]
    docs = ["\n\n".join(paragraphs[i : i + 3]) for i in range(0, len(paragraphs), 3)]
    docs[1] = "Crème brûlée, naïve façade — ünïcödé ✓\n" + docs[1]
    return docs


def test_user_jsonl_with_its_own_trained_tokenizer(tmp_path):
    docs = _user_documents()
    corpus = tmp_path / "mine.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(docs)))
    cfg = load_recipe(None, [f"data.cache_dir={tmp_path / 'cache'}", f"data.corpus={corpus}",
                             "data.json_key=content", "data.tokenizer_vocab_size=512", "data.split=80,20,0",
                             "model.seq_length=64", "train.steps=5", "train.eval_interval=5"])
    tokenizer, prefixes = prepare_data(cfg)
    trained = Path(tokenizer.path)  # trained from the user's corpus, keyed by its path and bytes
    assert trained.parent == tmp_path / "cache" and trained.name.startswith("mine_") and trained.name.endswith("_sp512.model")
    assert tokenizer.vocab_size == 512
    for doc in docs:
        assert tokenizer.detokenize(tokenizer.tokenize(doc)) == doc  # lossless, non-ASCII included
    assert len(_sequences(prefixes[0])) == len(docs)
    train, valid = build_gpt_datasets(cfg, tokenizer, prefixes)
    _check_samples(train, tokenizer, "\n".join(docs), 64)
    _check_samples(valid, tokenizer, "\n".join(docs), 64)

    # The corpus changes under the same name: a new key, so a new tokenizer and new tokens, unforced.
    old_tokenizer, old_prefix = tokenizer, prefixes[0]
    docs = [d.upper() for d in docs]
    corpus.write_text("".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(docs)))
    tokenizer, prefixes = prepare_data(cfg)
    assert tokenizer.path != old_tokenizer.path and prefixes[0] != old_prefix
    assert _sequences(prefixes[0]) == [tokenizer.tokenize(d) + [tokenizer.eod] for d in docs]
    assert all(tokenizer.detokenize(tokenizer.tokenize(d)) == d for d in docs)
    upper_text = "".join(docs)
    assert len(tokenizer.tokenize(upper_text)) < 0.8 * len(old_tokenizer.tokenize(upper_text))  # retrained


def test_user_text_file_is_one_document_and_uses_a_given_tokenizer(tmp_path):
    text = _bundled_texts()[7]
    corpus = tmp_path / "scene.txt.gz"
    with gzip.open(corpus, "wt", encoding="utf-8") as f:
        f.write(text)
    assert list(read_documents(corpus)) == [text]
    cfg = load_recipe(None, [f"data.cache_dir={tmp_path}", f"data.corpus={corpus}",
                             f"data.tokenizer_model={BUNDLED_TOKENIZER}"])
    tokenizer, (prefix,) = prepare_data(cfg)
    assert Path(tokenizer.path) == BUNDLED_TOKENIZER
    assert _sequences(prefix) == [tokenizer.tokenize(text) + [tokenizer.eod]]


def test_bad_data_inputs_name_the_key(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"body": "some text"}) + "\n")
    cfg = load_recipe(None, [f"data.cache_dir={tmp_path}", f"data.corpus={corpus}",
                             f"data.tokenizer_model={BUNDLED_TOKENIZER}"])
    with pytest.raises(KeyError, match=r"docs.jsonl:1 has no key 'text' \(keys: \['body'\]\); set data.json_key"):
        prepare_data(cfg)
    with pytest.raises(FileNotFoundError, match=r"data.corpus='/no/such.jsonl': no such file"):
        prepare_data(load_recipe(None, ["data.corpus=/no/such.jsonl"]))
    with pytest.raises(RecipeError, match=r"model.vocab_size=1000 is smaller than the tokenizer's vocabulary \(4096\)"):
        prepare_data(load_recipe(None, [f"data.cache_dir={tmp_path}", "model.vocab_size=1000"]))
    with pytest.raises(FileNotFoundError, match=r"data.data_path has prefixes without .bin/.idx files"):
        prepare_data(load_recipe(None, [f"data.data_path=[{tmp_path}/missing_text_document]"]))


def test_a_split_left_without_documents_is_an_error_not_a_hang(tmp_path):
    # megatron-core 0.16 loops forever building a split that rounds to zero documents.
    corpus = tmp_path / "five.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in _bundled_texts()[:5]))
    cfg = load_recipe(None, [f"data.cache_dir={tmp_path}", f"data.corpus={corpus}",
                             f"data.tokenizer_model={BUNDLED_TOKENIZER}", "data.split=95,5,0"])
    tokenizer, prefixes = prepare_data(cfg)
    with pytest.raises(ValueError, match=r"data.split='95,5,0' leaves the valid split of .* \(5 documents\) with no document"):
        build_gpt_datasets(cfg, tokenizer, prefixes)
    # An empty test split is skipped, with train/valid boundaries unchanged: 3 + 2 documents.
    cfg = load_recipe(None, [f"data.cache_dir={tmp_path}", f"data.corpus={corpus}",
                             f"data.tokenizer_model={BUNDLED_TOKENIZER}", "data.split=60,39,1",
                             "model.seq_length=64"])
    train, valid = build_gpt_datasets(cfg, tokenizer, prefixes)
    assert sorted(set(train.indices.tolist())) == [0, 1, 2]
    assert sorted(set(valid.indices.tolist())) == [3, 4]


def test_hugging_face_tokenizer_directory(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(_bundled_texts()[:20], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|end_of_text|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|end_of_text|>", pad_token="<pad>").save_pretrained(tmp_path / "hf")
    cfg = load_recipe(None, [f"data.cache_dir={tmp_path}", "data.tokenizer_type=HuggingFaceTokenizer",
                             f"data.tokenizer_model={tmp_path / 'hf'}", "model.seq_length=64"])
    tokenizer, (prefix,) = prepare_data(cfg)
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    assert (tokenizer.eod, tokenizer.pad) == (0, 1)
    text = _bundled_texts()[3]
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert _sequences(prefix)[3] == tokenizer.tokenize(text) + [0]


def _datasets_on_rank(rank: int, world_size: int, cache_dir: str) -> list[list[int]]:
    """Every rank builds the datasets (megatron-core: rank 0 writes the index cache, the rest wait)."""
    cfg = load_recipe(None, [f"data.cache_dir={cache_dir}", "model.seq_length=64"])
    tokenizer, prefixes = prepare_data(cfg) if rank == 0 else (None, None)
    torch.distributed.barrier()  # rank 0 tokenised the corpus; the others now read it
    if rank != 0:
        tokenizer, prefixes = prepare_data(cfg)
    train, _valid = build_gpt_datasets(cfg, tokenizer, prefixes)
    return [train[i]["tokens"].tolist() for i in (0, 5, len(train) - 1)]


def test_every_rank_gets_the_same_samples_under_torch_distributed(tmp_path):
    from tests._dist import run_distributed

    per_rank = run_distributed(2, _datasets_on_rank, str(tmp_path))
    assert per_rank[0] == per_rank[1]
    assert len(list((tmp_path / "index_cache").glob("*-GPTDataset-train-shuffle_index.npy"))) == 1
