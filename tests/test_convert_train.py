"""A converted released structure trains with our pretrain entry at CP = 4 as [2, 2] (a2a+p2p) on the CPU.

DeepSeek-V3 as released, shrunk (``test_convert_released``: MLA, YaRN 40 with ``mscale_all_dim``, 3 dense first
layers of 4, 16 experts in 8 groups with the top 4 groups and top 8, a shared expert), with the bundled
tokenizer's 4096-row vocabulary, is converted, and the recipe ``tiny_mla_cpu.yaml`` with the converted shape as its
``model`` section starts from it (``checkpoint.pretrained``). The first step sees exactly the Hugging Face weights,
the loss falls over 4 steps, and the trained checkpoint converts back to Hugging Face and passes ``verify``
(logits within 1e-4 of transformers'). The other families train the same way from their converted weights
(``test_every_converted_released_family_trains_at_cp4_and_converts_back``).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from mcp_context.convert.converter import hf_to_mcore, mcore_to_hf
from mcp_context.convert.model_config import HFModel

pytest.register_assert_rewrite("tests.convert_fixtures")
from tests._dist import run_distributed
from tests.convert_fixtures import load_safetensors_dir, seeded_hf_model
from tests.test_convert_families import _case_verify
from tests.test_convert_released import RELEASED

transformers = pytest.importorskip("transformers", reason="the Hugging Face side is built with transformers")
REPO = Path(__file__).resolve().parents[1]
STEPS = 4
# a Megatron parameter of each layer kind and the HF tensor it was converted from
WATCHED = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "decoder.layers.0.mlp.linear_fc2.weight": "model.layers.0.mlp.down_proj.weight",
           "decoder.layers.3.mlp.router.weight": "model.layers.3.mlp.gate.weight",
           "decoder.layers.3.self_attention.linear_kv_up_proj.weight": "model.layers.3.self_attn.kv_b_proj.weight"}


def _train_from(rank, world, record, pretrained, run_dir, data_dir, recipe="tiny_mla_cpu.yaml", watched=WATCHED):
    """Train ``recipe`` with the converted shape, from ``pretrained``; return (losses, the ``watched`` parameters
    at the first step, the last checkpoint)."""
    from mcp_context.pretrain import loop
    from mcp_context.pretrain.checkpoint import checkpoint_name
    from mcp_context.pretrain.launch import check_recipe_for_training, resolve_run_dir
    from mcp_context.recipes import load_recipe

    cfg = load_recipe(REPO / "recipes" / recipe, [
        f"train.steps={STEPS}", "train.lr_warmup_iters=0", "train.eval_interval=100", "train.eval_iters=0",
        "optimizer.lr=1e-2", "train.device=cpu", "train.global_batch_size=4", f"data.cache_dir={data_dir}",
        f"checkpoint.save_interval={STEPS}", f"checkpoint.pretrained={pretrained}"])
    layout = {k: getattr(cfg.model, k) for k in ("context_parallel_size", "hierarchical_context_parallel_sizes",
                                                  "cp_comm_type")}
    cfg.model = dataclasses.replace(HFModel.from_record(record).shape, seq_length=64, **layout)
    check_recipe_for_training(cfg, world)
    first, original_step = {}, loop.train_step

    def train_step(model, optimizer, scheduler, micro_batches, device, dynamic=None):
        if not first:
            params = dict(model.module.named_parameters())
            first.update({name: params[name].detach().clone() for name in watched})
        return original_step(model, optimizer, scheduler, micro_batches, device, dynamic)

    loop.train_step = train_step
    try:
        records = loop.train(cfg, resolve_run_dir(cfg, run_dir)).records
    finally:
        loop.train_step = original_step
    return [r["loss"] for r in records], first, str(Path(cfg.checkpoint.save) / checkpoint_name(STEPS))


def test_converted_deepseek_v3_trains_at_cp4_from_its_weights_and_converts_back(tmp_path):
    config_cls, sizes = RELEASED["deepseek_v3"]
    seeded_hf_model(getattr(transformers, config_cls)(**{**sizes, "vocab_size": 4096})).save_pretrained(tmp_path / "hf")
    arch = hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", progress=False)
    assert arch.shape.moe_layer_freq == [0, 0, 0, 1] and arch.shape.rope_type == "yarn"
    results = run_distributed(4, _train_from, arch.to_record(), str(tmp_path / "mcore"), str(tmp_path / "run"),
                              str(tmp_path / "data"), timeout=600)
    losses, first, checkpoint = results[0]
    assert all(r[0] == losses for r in results), [r[0] for r in results]  # the CP ranks report one loss
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.05, losses  # it trains
    hf = load_safetensors_dir(tmp_path / "hf")
    for name, hf_name in WATCHED.items():  # the first step sees the converted weights, bit for bit
        assert torch.equal(first[name], hf[hf_name]), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    mcore_to_hf(checkpoint, tmp_path / "trained_hf", hf_config=config, progress=False)
    trained = load_safetensors_dir(tmp_path / "trained_hf")
    assert not torch.equal(trained["model.layers.3.mlp.gate.weight"], hf["model.layers.3.mlp.gate.weight"])
    status, err = run_distributed(1, _case_verify, str(tmp_path / "trained_hf"), checkpoint)[0]
    assert status == 0, err


@pytest.mark.parametrize("family,recipe", [("qwen3", "tiny_qwen3_cpu.yaml"), ("mixtral", "tiny_mixtral_cpu.yaml"),
                                           ("qwen3_moe", "tiny_qwen3_moe_cpu.yaml"), ("gpt_oss", "tiny_gpt_oss_cpu.yaml")])
def test_every_converted_released_family_trains_at_cp4_and_converts_back(tmp_path, family, recipe):
    """The other released structures (Qwen3 with YaRN, Mixtral, Qwen3-MoE, gpt-oss with YaRN, sinks, windows and
    expert biases) start from their converted weights at CP = 4 [2, 2] (the first step sees the Hugging Face
    embedding bit for bit), train 4 steps with a falling loss, and the trained checkpoint converts back and passes
    ``verify``. gpt-oss trains through ``megatron_patches.expert_bias_in_place`` (megatron-core's expert MLP adds
    its bias in place on a view autograd refuses)."""
    config_cls, sizes = RELEASED[family]
    seeded_hf_model(getattr(transformers, config_cls)(**{**sizes, "vocab_size": 4096})).save_pretrained(tmp_path / "hf")
    arch = hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", progress=False)
    embedding = {"embedding.word_embeddings.weight": "model.embed_tokens.weight"}
    results = run_distributed(4, _train_from, arch.to_record(), str(tmp_path / "mcore"), str(tmp_path / "run"),
                              str(tmp_path / "data"), recipe, embedding, timeout=600)
    losses, first, checkpoint = results[0]
    assert all(r[0] == losses for r in results), [r[0] for r in results]
    assert len(losses) == STEPS and all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    hf = load_safetensors_dir(tmp_path / "hf")
    for name, hf_name in embedding.items():
        assert torch.equal(first[name], hf[hf_name]), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    mcore_to_hf(checkpoint, tmp_path / "trained_hf", hf_config=config, progress=False)
    status, err = run_distributed(1, _case_verify, str(tmp_path / "trained_hf"), checkpoint)[0]
    assert status == 0, err
