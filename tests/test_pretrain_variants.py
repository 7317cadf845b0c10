"""Today's attention and MLP variants train with our pretrain entry on CPU at CP=4 as [2, 2] (a2a+p2p).

Each shipped variant recipe (``recipes/tiny_gpt_oss_cpu.yaml``: learned sinks, alternating sliding
windows, clamped GLU with offset, biases; ``recipes/tiny_mla_cpu.yaml``: MLA with dqk 24 != dv
16, YaRN, latent norms, sigmoid-routed group-limited MoE with expert bias and a shared expert) runs a few
steps on 4 gloo ranks. The model must be the one the recipe describes (MLATransformerConfig, the
sinks' ``softmax_offset`` among the trained parameters and moved by the optimizer, experts and
router present), every rank must report the same losses, and the loss must fall. Its equality with
megatron-core at CP=1 is tested per layer in tests/test_megatron_*.py; this is the whole entry.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests._dist import run_distributed

REPO = Path(__file__).resolve().parents[1]
STEPS = 4
SHORT = [f"train.steps={STEPS}", "train.lr_warmup_iters=0", "train.eval_interval=100", "train.eval_iters=0",
         "optimizer.lr=1e-2", "train.device=cpu"]


def _train(rank, world, recipe, run_dir, overrides):
    """Train ``recipe`` for a few steps; return (losses, parameter names, config class, how far each learned
    sink moved, how far each router's expert bias moved)."""
    from mcp_context.pretrain import loop
    from mcp_context.pretrain.launch import check_recipe_for_training, resolve_run_dir
    from mcp_context.recipes import load_recipe

    cfg = load_recipe(REPO / "recipes" / f"{recipe}.yaml", overrides)
    cfg.checkpoint.save = None
    check_recipe_for_training(cfg, world)
    built, original_step = {}, loop.train_step

    def train_step(model, optimizer, scheduler, micro_batches, device, dynamic=None):
        params = dict(model.module.named_parameters())
        if not built:
            buffers = dict(model.module.named_buffers())
            built.update(names=sorted(params), config=type(model.module.config).__name__, buffers=buffers,
                         sinks={n: p.detach().clone() for n, p in params.items() if n.endswith("softmax_offset")},
                         biases={n: b.clone() for n, b in buffers.items() if n.endswith("expert_bias")})
        record = original_step(model, optimizer, scheduler, micro_batches, device, dynamic)
        built["moved"] = {n: (params[n].detach() - p).abs().max().item() for n, p in built["sinks"].items()}
        built["bias_moved"] = {n: (built["buffers"][n] - b).abs().max().item() for n, b in built["biases"].items()}
        return record

    loop.train_step = train_step
    try:
        records = loop.train(cfg, resolve_run_dir(cfg, run_dir)).records
    finally:
        loop.train_step = original_step
    return [r["loss"] for r in records], built["names"], built["config"], built["moved"], built["bias_moved"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("variant_data")


def _run(recipe, data_dir, tmp_path):
    results = run_distributed(4, _train, recipe, str(tmp_path), SHORT + [f"data.cache_dir={data_dir}"])
    losses = results[0][0]
    assert all(r[0] == losses for r in results), [r[0] for r in results]  # CP ranks report one loss
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.05, losses  # it trains
    return results[0][1:]


def test_gpt_oss_style_recipe_trains_with_learned_sinks_and_alternating_windows(data_dir, tmp_path):
    names, config, moved, _ = _run("tiny_gpt_oss_cpu", data_dir, tmp_path)
    assert config == "TransformerConfig"
    assert len(moved) == 2 and all(v > 0 for v in moved.values()), moved  # one learned sink per layer, trained
    assert any(n.endswith("linear_qkv.bias") for n in names)  # add_bias_linear


def test_mla_recipe_trains_with_value_head_dim_unlike_query_key(data_dir, tmp_path):
    names, config, moved, bias_moved = _run("tiny_mla_cpu", data_dir, tmp_path)
    assert config == "MLATransformerConfig" and moved == {}
    assert len(bias_moved) == 2 and all(v > 0 for v in bias_moved.values()), bias_moved  # aux-loss-free balancing
    assert any(".self_attention.linear_kv_down_proj." in n for n in names)
    assert any(".self_attention.kv_layernorm." in n for n in names)  # latent norms (qk_layernorm)
    assert any(".mlp.shared_experts." in n for n in names) and any(".mlp.experts." in n for n in names)
