"""Conversion tests of the command line: ``verify`` tokenizes a prompt and reports the logit
difference, accepts a training checkpoint and its export, names the tensors of a mismatched pair;
errors are one line with exit status 2 (the full catalogue of bad input is test_convert_malformed.py).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcp_context.convert import mcore_io
from mcp_context.convert.__main__ import main
from mcp_context.convert.converter import hf_to_mcore, mcore_to_hf
from mcp_context.convert.model_config import HFModel

pytest.register_assert_rewrite("tests.convert_fixtures")  # also loaded as a plugin below: rewrite it first
from tests._dist import run_distributed
from tests.convert_fixtures import LOGIT_ATOL, build_hf_model, init_megatron, tokens

pytest.importorskip("transformers", reason="the HF side of conversion tests needs transformers")
pytest.importorskip("safetensors", reason="the independent safetensors reader/writer is the reference")
pytest_plugins = ["tests.convert_fixtures"]  # the `converted` fixture, built once a session


def _case_verify_cli(rank, world_size, hf_dir, mcore_dir, *options):
    """``verify --hf hf_dir --mcore mcore_dir *options`` -> (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["verify", "--hf", hf_dir, "--mcore", mcore_dir, *options])
    return status, out.getvalue(), err.getvalue()


def test_verify_command_tokenizes_the_prompt_and_reports_logit_difference_below_tolerance(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = build_hf_model("llama_gqa_rope3")
    words = ["[UNK]", "the", "capital", "of", "france", "is", "paris", "and", "a", "city"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    model.save_pretrained(tmp_path / "hf")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", progress=False)
    status, text, _ = run_distributed(1, _case_verify_cli, str(tmp_path / "hf"), str(tmp_path / "mcore"), "--prompt",
                                      "the capital of france is paris and the city of paris is a capital")[0]
    assert status == 0, text
    diff = float(text.split("max |logit difference| = ")[1].split()[0])
    assert diff <= LOGIT_ATOL and "over 14 tokens" in text
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)  # the tokenizer travels with the checkpoint
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()


@pytest.fixture(scope="module")
def training_export(tmp_path_factory):
    """(checkpoint of 1 step of the pretrain entry on the tiny recipe at world size 1, its mcore-to-hf export)."""
    root = tmp_path_factory.mktemp("trained")
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "tools/pretrain.py", "--recipe",
         "recipes/tiny_cpu.yaml", "--run-dir", str(root / "run"), "train.world_size=1", "train.steps=1",
         "train.global_batch_size=2", "train.lr_warmup_iters=0", "model.context_parallel_size=1",
         "model.hierarchical_context_parallel_sizes=null", "model.cp_comm_type=p2p", f"data.cache_dir={root / 'data'}"],
        cwd=repo, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = root / "run" / "checkpoints" / "iter_0000001"
    vocab = mcore_io.McoreCheckpointReader(ckpt).shape("embedding.word_embeddings.weight")[0]  # padded
    config = {"model_type": "llama", "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False}
    mcore_to_hf(ckpt, root / "hf", hf_config=config, progress=False)
    return ckpt, root / "hf"


def test_verify_accepts_a_training_checkpoint_and_its_export(training_export):
    ckpt, hf_dir = training_export
    keys = mcore_io.McoreCheckpointReader(ckpt).keys()
    assert any(k.startswith("optimizer.") for k in keys) and (ckpt / "recipe.yaml").is_file()  # not a conversion
    status, text, err = run_distributed(1, _case_verify_cli, str(hf_dir), str(ckpt))[0]
    assert status == 0, text + err
    assert float(text.split("max |logit difference| = ")[1].split()[0]) <= LOGIT_ATOL


def test_verify_names_the_tensors_of_a_mismatched_pair(converted, tmp_path, capsys):
    from mcp_context.convert.random_checkpoint import write_random_hf_checkpoint

    # different models: refused before anything is built, naming the first tensor that disagrees
    assert main(["verify", "--hf", str(converted["qwen2_bias_tied"][0]),
                 "--mcore", str(converted["llama_gqa_rope3"][1])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "do not hold the same model" in err and "linear_qkv.bias" in err, err
    # the same model with other weights: the logits differ and the failure names the tensors
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    write_random_hf_checkpoint(tmp_path / "a", config, torch.float32, seed=0)
    write_random_hf_checkpoint(tmp_path / "b", config, torch.float32, seed=1)
    hf_to_mcore(tmp_path / "b", tmp_path / "b_mcore", progress=False)
    status, _, err = run_distributed(1, _case_verify_cli, str(tmp_path / "a"), str(tmp_path / "b_mcore"))[0]
    assert status == 1
    assert "verify: FAILED: 21 tensor(s) differ between --hf and --mcore, e.g. ['model.embed_tokens.weight'" in err, err


def test_cli_reports_errors_in_one_line_with_exit_status_2(converted, tmp_path, capsys):
    hf_dir, mcore_dir, _, _ = converted["qwen2_bias_tied"]
    config = json.loads((hf_dir / "config.json").read_text())
    # three layers (and, as transformers requires, three layer_types) against a two-layer checkpoint
    (tmp_path / "cfg.json").write_text(json.dumps({**config, "num_hidden_layers": 3,
                                                   "layer_types": ["full_attention"] * 3}))
    status = main(["mcore-to-hf", "--mcore", str(mcore_dir), "--hf", str(tmp_path / "x"),
                   "--hf-config", str(tmp_path / "cfg.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in err and "[3, 64]" in err
    assert not (tmp_path / "x").exists()


def _devices_fed(model: torch.nn.Module, run) -> set[str]:
    """Run ``run()`` and return the devices of every tensor ``model`` is called with (arguments and
    keyword arguments) during it."""
    seen: set[str] = set()

    def record(module, args, kwargs):
        seen.update(str(t.device) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        run()
    finally:
        hook.remove()
    return seen


def _case_verify_forward_devices(rank, world_size, hf_dir, arch, device):
    from megatron.core import parallel_state

    from mcp_context.convert.verify import build_gpt_model, hf_logits, load_hf_model, mcore_logits

    init_megatron()
    try:
        logits, held = {}, {}
        mcore = build_gpt_model(HFModel.from_record(arch).shape, device=device)
        hf = load_hf_model(hf_dir, device)
        fed = {"mcore": _devices_fed(mcore, lambda: logits.update(mcore=mcore_logits(mcore, tokens()))),
               "hf": _devices_fed(hf, lambda: logits.update(hf=hf_logits(hf, tokens())))}
        for side, model in (("mcore", mcore), ("hf", hf)):
            held[side] = {str(t.device) for t in [*model.parameters(), *model.buffers()]}
        held["mcore"].add(str(mcore.rotary_pos_emb.inv_freq.device))  # a plain attribute, not a buffer
        return fed, held, {side: str(out.device) for side, out in logits.items()}
    finally:
        parallel_state.destroy_model_parallel()


def test_verify_runs_both_models_on_the_requested_device_whatever_device_the_token_ids_are_on(converted):
    """The forward verify runs, on ``meta`` (a device other than the CPU the token ids are made on, as
    ``cuda`` is on a GPU machine): every tensor fed to either model (token ids, positions, mask), every
    weight, buffer and RoPE frequency, and both sides' logits, are on that device."""
    hf_dir, _, arch, _ = converted["llama_gqa_rope3"]
    fed, held, out = run_distributed(1, _case_verify_forward_devices, str(hf_dir), arch, "meta")[0]
    assert fed == held == {"mcore": {"meta"}, "hf": {"meta"}}, (fed, held)
    assert out == {"mcore": "meta", "hf": "meta"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_verify_refuses_a_device_it_cannot_run_on_in_one_line(converted, capsys):
    hf_dir, mcore_dir, _, _ = converted["llama_gqa_rope3"]
    for device, message in (("cuda", "--device 'cuda' but this torch sees no CUDA device; pass --device cpu"),
                            ("meta", "--device 'meta': verify runs on cpu or cuda, not meta"),
                            ("gpu0", "--device 'gpu0' is not a torch device; pass cpu, cuda or cuda:N")):
        assert main(["verify", "--hf", str(hf_dir), "--mcore", str(mcore_dir), "--device", device]) == 2
        assert capsys.readouterr().err == f"error: {message}\n"
