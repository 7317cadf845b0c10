"""Recipes: YAML + dotted overrides with type checks, layout validation, save/load, Megatron-LM flags.

Every bad recipe the issue names must fail in ``load_recipe``/``validate_recipe`` (pure functions,
no process group) with a message naming the key; the shipped recipes must validate, build a real
``TransformerConfig``, and translate into ``pretrain_gpt.py`` flags that parse back to their values.
"""
from __future__ import annotations

import argparse
import ast
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mcp_context.recipes import RecipeConfig, RecipeError, load_recipe, save_recipe, validate_recipe
from mcp_context.recipes.__main__ import main as recipes_cli
from mcp_context.recipes.schema import gpt_model_kwargs, transformer_config_kwargs
from mcp_context.megatron_lm import TOKENIZER_TYPES, format_megatron_command, megatron_split

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
SHIPPED = sorted(RECIPES_DIR.glob("*.yaml"))


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_recipes_exist():
    names = {p.stem for p in SHIPPED}
    assert {"tiny_cpu", "llama3_8b_128k", "llama3_8b_128k_hcp", "llama3_70b_1m_hcp"} <= names


def test_tiny_recipe_file_is_the_embedded_default():
    assert load_recipe(RECIPES_DIR / "tiny_cpu.yaml") == RecipeConfig()


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipes_validate_and_say_what_cluster(path):
    cfg = load_recipe(path)
    validate_recipe(cfg)
    assert cfg.name == path.stem
    assert "Cluster:" in path.read_text(), "each recipe states the cluster it assumes"


def test_public_llama3_8b_128k_layout():
    m = load_recipe(RECIPES_DIR / "llama3_8b_128k.yaml").model
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size) == (4, 2, 8)
    assert m.sequence_parallel and m.seq_length == 131072 and m.cp_comm_type == "p2p"
    hcp = load_recipe(RECIPES_DIR / "llama3_8b_128k_hcp.yaml").model
    assert hcp.cp_comm_type == "a2a+p2p" and hcp.hierarchical_context_parallel_sizes == [2, 4]
    big = load_recipe(RECIPES_DIR / "llama3_70b_1m_hcp.yaml").model
    assert big.seq_length == 2**20 and len(big.hierarchical_context_parallel_sizes) >= 2


def test_overrides_win_over_the_file_and_are_typed(tmp_path):
    path = _write(tmp_path, {"model": {"context_parallel_size": 2, "hierarchical_context_parallel_sizes": [2, 1]},
                             "train": {"steps": 7}, "optimizer": {"lr": "1e-3"}})
    cfg = load_recipe(path, ["model.context_parallel_size=8", "model.hierarchical_context_parallel_sizes=[2, 4]",
                             "train.steps=100", "optimizer.lr=1e-4", "checkpoint.load=null"])
    assert cfg.model.context_parallel_size == 8
    assert cfg.model.hierarchical_context_parallel_sizes == [2, 4]
    assert cfg.train.steps == 100 and isinstance(cfg.train.steps, int)
    assert cfg.optimizer.lr == 1e-4 and isinstance(cfg.optimizer.lr, float)  # YAML reads 1e-4 as a string
    assert cfg.checkpoint.load is None
    assert load_recipe(path).optimizer.lr == 1e-3  # the file alone, "1e-3" read as a float


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps=abc", "train.steps='abc' has type str, but train.steps must be int"),
        ("train.steps=2.5", "train.steps=2.5 has type float, but train.steps must be int"),
        ("train.steps=true", "train.steps=True has type bool, but train.steps must be int"),
        ("model.sequence_parallel=1", "model.sequence_parallel=1 has type int, but model.sequence_parallel must be bool"),
        ("model.hierarchical_context_parallel_sizes=[2, x]", "model.hierarchical_context_parallel_sizes[1]='x'"),
        ("model.hierarchical_context_parallel_sizes=4", "must be a list of int"),
        ("model.normalization=RMSnorm", "did you mean 'RMSNorm'?"),
        ("optimizer.lr=fast", "optimizer.lr='fast' has type str, but optimizer.lr must be float"),
        ("model.contex_parallel_size=2", "unknown recipe key 'model.contex_parallel_size'; did you mean model.context_parallel_size?"),
        ("modle.num_layers=2", "unknown recipe key 'modle'; did you mean model?"),
        ("train.steps.count=3", "train.steps is a value, not a section"),
        ("data=3", "data is a section: give it a mapping"),
        ("train.steps", "must look like section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(None, [override])
    assert message in str(err.value)


def test_unknown_key_in_file_at_any_depth(tmp_path):
    with pytest.raises(RecipeError, match=r"unknown recipe key 'model\.num_layer'; did you mean model\.num_layers\?"):
        load_recipe(_write(tmp_path, {"model": {"num_layer": 2}}))
    with pytest.raises(RecipeError, match=r"unknown recipe key 'trainer'; did you mean train\?"):
        load_recipe(_write(tmp_path, {"trainer": {"steps": 2}}))
    with pytest.raises(RecipeError, match=r"train\.global_batch_size='8' has type str"):
        load_recipe(_write(tmp_path, {"train": {"global_batch_size": "8"}}))
    assert load_recipe(_write(tmp_path, {"logging": None})) == RecipeConfig()  # all keys commented out


# Each case: overrides on the tiny default (CP 4 = [2, 2], a2a+p2p, 4 heads, 2 KV heads, seq 256,
# world size 4), and a fragment of the error, which must name the key at fault.
DYNAMIC_CP = ["model.hybrid_context_parallel=true", "model.max_seqlen_per_dp_cp_rank=64", "model.context_parallel_size=1",
              "data.reset_attention_mask=true"]
"""The tiny recipe with dynamic CP over its 4 ranks (hierarchy [2, 2] now over the data parallel group)."""

BAD_LAYOUTS = [
    (["model.hierarchical_context_parallel_sizes=[3, 3]"],
     "model.hierarchical_context_parallel_sizes=[3, 3] multiply to 9, but model.context_parallel_size=4; "
     "choose sizes whose product is 4"),
    (["model.cp_comm_type=ring"], "model.cp_comm_type='ring' is not a known cp_comm_type; choose one of"),
    (["model.cp_comm_type=a2a_p2p"], "did you mean 'a2a+p2p'?"),
    (["model.hierarchical_context_parallel_sizes=null"],
     "model.cp_comm_type='a2a+p2p' needs model.hierarchical_context_parallel_sizes"),
    (["model.hierarchical_context_parallel_sizes=[4]"],
     "model.cp_comm_type='a2a+p2p' needs model.hierarchical_context_parallel_sizes with at least 2 levels"),
    (["model.seq_length=250"],
     "model.seq_length 250 is not divisible by 2*cp=8 for layout 'zigzag'; pad to 256"),
    (["model.tensor_model_parallel_size=2", "model.sequence_parallel=true", "model.seq_length=264", "train.world_size=8"],
     "model.seq_length 264 is not divisible by 2*cp=8 for layout 'zigzag' * tp=2 for sequence parallelism; "
     "pad to 272"),
    (["model.sequence_parallel=true"], "model.sequence_parallel=true needs model.tensor_model_parallel_size > 1"),
    (["model.tensor_model_parallel_size=3", "train.world_size=12"],
     "model.num_attention_heads=4 is not divisible by model.tensor_model_parallel_size=3"),
    (["model.num_query_groups=3"], "model.num_attention_heads=4 is not divisible by model.num_query_groups=3"),
    (["model.num_attention_heads=2", "model.num_query_groups=2", "model.tensor_model_parallel_size=2",
      "train.world_size=8"],
     "query heads per TP rank, model.num_attention_heads/tensor_model_parallel_size=1 is not divisible by the "
     "all-to-all degree model.hierarchical_context_parallel_sizes[0]=2 (comm='a2a+p2p')"),
    (["model.cp_comm_type=a2a", "model.hierarchical_context_parallel_sizes=null", "model.context_parallel_size=8",
      "train.world_size=8"],
     "is not divisible by the all-to-all degree model.context_parallel_size=8 (comm='a2a')"),
    (["model.num_attention_heads=12", "model.num_query_groups=3", "model.hierarchical_context_parallel_sizes=[4, 1]"],
     "key/value heads per TP rank, model.num_query_groups/tensor_model_parallel_size=3 cannot be replicated "
     "evenly over the all-to-all degree model.hierarchical_context_parallel_sizes[0]=4"),
    (["model.hidden_size=96", "model.num_attention_heads=12", "model.num_query_groups=3", "model.kv_channels=8",
      "model.tensor_model_parallel_size=2", "model.cp_comm_type=p2p", "model.hierarchical_context_parallel_sizes=null",
      "train.world_size=8"],
     "model.num_query_groups=3 must be a multiple or a divisor of model.tensor_model_parallel_size=2"),
    (["train.global_batch_size=6", "train.world_size=8"],
     "train.global_batch_size=6 is not divisible by train.micro_batch_size * data-parallel size = 2 * 2; "
     "use a multiple of 4"),
    (["train.global_batch_size=7"], "train.global_batch_size=7 is not divisible by train.micro_batch_size=2"),
    (["train.world_size=6"], "world size 6 (train.world_size or WORLD_SIZE) is not divisible by "
                             "tensor * pipeline * context parallel sizes = 4"),
    (["model.pipeline_model_parallel_size=3", "train.world_size=12"],
     "model.num_layers=2 is not divisible by model.pipeline_model_parallel_size=3"),
    (["model.context_parallel_size=0"], "model.context_parallel_size=0 must be a positive integer"),
    (["train.lr_warmup_iters=80"], "train.lr_warmup_iters=80 must be at least 0 and less than the decay length"),
    (["train.lr_warmup_iters=50"], "megatron-core's scheduler asserts warm-up < decay"),
    (["optimizer.min_lr=1.0"], "optimizer.min_lr=1.0 must be between 0 and optimizer.lr=0.003"),
    (["data.split=90-10"], "data.split='90-10' must be up to three non-negative train,valid,test weights"),
    (["data.tokenizer_type=HuggingFaceTokenizer"], "needs data.tokenizer_model"),
    (["data.reset_attention_mask=true", "data.create_attention_mask=true"],
     "data.create_attention_mask=true would build an [s, s] mask per sample that the packed attention cannot take"),
    # dynamic CP (model.hybrid_context_parallel): the budget, the hierarchy over the data parallel group, the runner
    (["model.max_seqlen_per_dp_cp_rank=64"], "model.max_seqlen_per_dp_cp_rank=64 is the budget of dynamic CP, which "
                                              "is off; set model.hybrid_context_parallel=true"),
    (DYNAMIC_CP + ["model.max_seqlen_per_dp_cp_rank=null"],
     "model.hybrid_context_parallel=True needs model.max_seqlen_per_dp_cp_rank"),
    (DYNAMIC_CP + ["model.max_seqlen_per_dp_cp_rank=60"],
     "model.max_seqlen_per_dp_cp_rank=60 is not a multiple of 2 x 4 ranks = 8: every document is padded to that "
     "multiple (zigzag's two chunks a rank on the largest group), so only multiples of it bound a group exactly; "
     "use 56 or 64"),
    (DYNAMIC_CP + ["model.max_seqlen_per_dp_cp_rank=56"],
     "model.max_seqlen_per_dp_cp_rank=56: a document as long as a sample (model.seq_length=256, padded to 256) does "
     "not fit all 4 ranks (224 tokens at most); raise it to at least 64"),
    (DYNAMIC_CP + ["model.hierarchical_context_parallel_sizes=[2, 4]"],
     "model.hierarchical_context_parallel_sizes=[2, 4] multiplies to 8, but with model.hybrid_context_parallel=true "
     "it describes the data parallel group of all 4 ranks; make the product 4"),
    (DYNAMIC_CP + ["model.context_parallel_size=4"],
     "model.hybrid_context_parallel=True with model.context_parallel_size=4"),
    (DYNAMIC_CP + ["data.reset_attention_mask=false"],
     "model.hybrid_context_parallel=true spreads a step's documents (split at the end-of-document tokens) over "
     "groups of ranks, each attending only to itself; set data.reset_attention_mask=true"),
    (DYNAMIC_CP + ["model.tensor_model_parallel_size=2", "train.world_size=8"],
     "model.tensor_model_parallel_size=2 with model.hybrid_context_parallel=true: the dynamic CP step runner "
     "(mcp_context.pretrain.dynamic) is built and tested for dense fp32 models at TP = PP = 1 only; set it to 1"),
    (DYNAMIC_CP + ["model.bf16=true", "model.params_dtype=bfloat16"],
     "model.params_dtype='bfloat16' with model.hybrid_context_parallel=true"),
]


@pytest.mark.parametrize("overrides, message", BAD_LAYOUTS, ids=lambda x: x if isinstance(x, str) else None)
def test_bad_layouts_fail_before_any_process_group(overrides, message):
    import torch.distributed as dist

    cfg = load_recipe(None, overrides)
    with pytest.raises(RecipeError) as err:
        validate_recipe(cfg)
    assert message in str(err.value)
    assert not dist.is_initialized()


def test_world_size_comes_from_the_launcher_when_the_recipe_leaves_it_open(monkeypatch):
    cfg = load_recipe(None, ["train.world_size=null", "train.global_batch_size=6"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    validate_recipe(cfg)  # DP unknown: only gbs % mbs is checked, and 6 % 2 == 0
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(RecipeError, match=r"micro_batch_size \* data-parallel size = 2 \* 2"):
        validate_recipe(cfg)
    validate_recipe(cfg, world_size=4)  # an explicit world size wins over the variable
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(RecipeError, match=r"train.world_size=4 but the launch has 8 ranks; set train.world_size=8"):
        validate_recipe(load_recipe(None), world_size=8)


def test_saved_recipe_round_trips_and_is_written_atomically(tmp_path):
    cfg = load_recipe(RECIPES_DIR / "llama3_70b_1m_hcp.yaml", ["train.steps=123", "optimizer.lr=2e-5"])
    target = save_recipe(cfg, tmp_path / "iter_0000100")
    assert target.name == "recipe.yaml"
    assert sorted(p.name for p in target.parent.iterdir()) == ["recipe.yaml"]  # no temporary left behind
    assert target.stat().st_mode & stat.S_IRGRP, "the saved recipe is readable by others (not mkstemp's 0600)"
    assert load_recipe(target) == cfg
    save_recipe(load_recipe(None), target.parent)  # overwrite in place
    assert load_recipe(target) == RecipeConfig()


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_transformer_config_kwargs_build_a_real_transformer_config(path):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import MLATransformerConfig

    from mcp_context.recipes.schema import transformer_config_class

    cfg = load_recipe(path)
    m = cfg.model
    tc = transformer_config_class(m)(**transformer_config_kwargs(m))
    assert isinstance(tc, MLATransformerConfig) == m.multi_latent_attention
    for name in ("softmax_type", "qk_layernorm", "num_moe_experts", "moe_router_topk", "glu_linear_offset",
                 "activation_func_clamp_value", "window_size", "window_attn_skip_freq"):
        assert getattr(tc, name) == (tuple(m.window_size) if name == "window_size" and m.window_size
                                     else getattr(m, name)), name
    if m.multi_latent_attention:  # MLA's own RoPE reads these from the config
        assert (tc.q_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim, tc.rope_type) == (
            m.q_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.rope_type)
        assert (tc.rotary_base, tc.rotary_percent, tc.rotary_scaling_factor) == (m.rotary_base, m.rotary_percent,
                                                                                m.rotary_scaling_factor)
    assert tc.context_parallel_size == m.context_parallel_size
    assert tc.hierarchical_context_parallel_sizes == m.hierarchical_context_parallel_sizes
    assert tc.cp_comm_type == m.cp_comm_type
    assert tc.sequence_parallel == m.sequence_parallel
    assert tc.num_query_groups == (m.num_query_groups or m.num_attention_heads)
    assert tc.ffn_hidden_size == m.ffn_hidden_size
    if m.activation_func == "quick_gelu":  # megatron-core's MLP picks the clamped, offset GLU by identity
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        assert tc.activation_func is quick_gelu and tc.gated_linear_unit
    else:
        assert tc.activation_func is F.silu and tc.gated_linear_unit
    assert tc.params_dtype == getattr(torch, m.params_dtype)
    gpt = gpt_model_kwargs(cfg.model, cfg.padded_vocab_size(128256))
    multiple = m.make_vocab_size_divisible_by * m.tensor_model_parallel_size
    assert gpt["vocab_size"] % multiple == 0 and 0 <= gpt["vocab_size"] - 128256 < multiple
    assert gpt["max_sequence_length"] == m.seq_length


def test_every_megatron_model_the_package_builds_comes_from_the_one_translation():
    """Pretraining, the converter and the self-test build ``TransformerConfig`` (or the class
    ``transformer_config_class`` picks) and ``GPTModel`` only from ``transformer_config_kwargs`` /
    ``gpt_model_kwargs``: no second translation can drift."""
    import ast

    def built(func) -> str:  # TransformerConfig(...) or transformer_config_class(model)(...), its MLA-aware spelling
        if isinstance(func, ast.Call) and getattr(func.func, "id", None) == "transformer_config_class":
            return "TransformerConfig"
        return getattr(func, "id", None)

    def spread_from(value, assigned: dict) -> str:  # **f(...), or **name where name = f(...) in the same file
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            return value.func.id
        name = assigned.get(getattr(value, "id", None), "")
        return name if name.endswith("_kwargs") else ""

    builders = []
    for path in sorted((RECIPES_DIR.parent / "mcp_context").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assigned = {t.id: n.value.func.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                    and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
                    for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and built(node.func) in ("TransformerConfig", "GPTModel"):
                spread = [f for f in (spread_from(kw.value, assigned) for kw in node.keywords if kw.arg is None) if f]
                builders.append((path.parent.name, built(node.func), spread))
    assert sorted(builders) == [
        ("convert", "GPTModel", ["gpt_model_kwargs"]), ("convert", "TransformerConfig", ["transformer_config_kwargs"]),
        ("convert", "TransformerConfig", ["transformer_config_kwargs"]),  # model_config: refused before converting
        ("pretrain", "GPTModel", ["gpt_model_kwargs"]), ("pretrain", "TransformerConfig", ["transformer_config_kwargs"]),
        ("selftest", "GPTModel", ["gpt_model_kwargs"]),  # dynamic.step's model
        ("selftest", "TransformerConfig", ["transformer_config_kwargs"]),
    ]


def test_allgather_alias_is_passed_on_in_transformer_engine_spelling():
    cfg = load_recipe(None, ["model.cp_comm_type=allgather", "model.hierarchical_context_parallel_sizes=null"])
    validate_recipe(cfg)
    assert transformer_config_kwargs(cfg.model)["cp_comm_type"] == "all_gather"
    argv = shlex.split(_command_argv(format_megatron_command(cfg)))
    assert argv[argv.index("--cp-comm-type") + 1] == "all_gather"


def _megatron_lm_parser() -> argparse.ArgumentParser:
    """The flags we emit, declared as Megatron-LM's arguments.py declares them (types, nargs, actions)."""
    p = argparse.ArgumentParser(prog="pretrain_gpt.py")
    ints = ["--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
            "--kv-channels", "--seq-length", "--max-position-embeddings", "--rotary-base",
            "--make-vocab-size-divisible-by", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
            "--num-virtual-stages-per-pipeline-rank", "--context-parallel-size", "--recompute-num-layers",
            "--num-workers", "--micro-batch-size", "--global-batch-size", "--train-iters", "--lr-warmup-iters",
            "--lr-decay-iters", "--eval-interval", "--eval-iters", "--seed", "--save-interval", "--log-interval",
            "--max-seqlen-per-dp-cp-rank", "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk", "--moe-shared-expert-intermediate-size",
            "--moe-router-num-groups", "--moe-router-group-topk", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
            "--qk-pos-emb-head-dim", "--v-head-dim"]
    floats = ["--rotary-percent", "--rope-scaling-factor", "--norm-epsilon", "--attention-dropout",
              "--hidden-dropout", "--init-method-std", "--lr", "--min-lr", "--weight-decay", "--adam-beta1",
              "--adam-beta2", "--adam-eps", "--clip-grad", "--glu-linear-offset", "--activation-func-clamp-value",
              "--rotary-scaling-factor", "--mscale", "--mscale-all-dim", "--moe-router-topk-scaling-factor"]
    strs = ["--position-embedding-type", "--normalization", "--transformer-impl", "--recompute-granularity",
            "--recompute-method", "--split", "--tokenizer-type", "--tokenizer-model", "--data-cache-path",
            "--lr-decay-style", "--optimizer", "--save", "--load", "--tensorboard-dir", "--wandb-project"]
    flags = ["--group-query-attention", "--use-rope-scaling", "--swiglu", "--squared-relu", "--disable-bias-linear",
             "--add-qkv-bias", "--untie-embeddings-and-output-weights", "--sequence-parallel", "--bf16", "--fp16",
             "--no-create-attention-mask-in-dataloader", "--reset-position-ids", "--reset-attention-mask",
             "--eod-mask-loss", "--use-distributed-optimizer", "--quick-geglu", "--qk-layernorm",
             "--multi-latent-attention", "--moe-router-pre-softmax", "--moe-router-enable-expert-bias",
             "--hybrid-context-parallel", "--calculate-per-token-loss"]
    # TransformerConfig's Literal fields (Megatron-LM's ArgumentGroupFactory gives them choices) and the MLA group's.
    p.add_argument("--softmax-type", type=str, choices=("vanilla", "off-by-one", "learnable"), default="vanilla")
    p.add_argument("--rope-type", type=str, choices=("rope", "yarn"), default=None)
    p.add_argument("--moe-router-score-function", type=str, choices=("softmax", "sigmoid"), default="softmax")
    p.add_argument("--moe-router-load-balancing-type", nargs="+", type=str, default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    p.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    p.add_argument("--moe-layer-freq", type=lambda x: ast.literal_eval(x) if "[" in x else int(x), default=1)
    for f in ints:
        p.add_argument(f, type=int)
    for f in floats:
        p.add_argument(f, type=float)
    for f in strs:
        p.add_argument(f, type=str)
    for f in flags:
        p.add_argument(f, action="store_true")
    p.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    p.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None)
    p.add_argument("--spec", type=str, default=None, nargs="*")
    p.add_argument("--data-path", nargs="*", default=None)
    p.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion")
    p.add_argument("--no-persist-layer-norm", action="store_false", dest="persist_layer_norm")
    p.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion")
    p.add_argument("--yarn-original-max-position-embeddings", type=int, default=None)  # after core_v0.16.1
    p.add_argument("--yarn-beta-fast", type=float, default=None)
    p.add_argument("--yarn-beta-slow", type=float, default=None)
    p.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None)
    p.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                   dest="yarn_correction_range_round_to_int")
    p.add_argument("--window-size", type=lambda x: tuple(int(i) for i in x.strip("()").split(",")), default=None)
    return p


def _command_argv(command: str) -> str:
    """The arguments after ``pretrain_gpt.py`` in a printed command (comments and launcher dropped)."""
    body = " ".join(line.rstrip("\\").strip() for line in command.splitlines() if not line.startswith("#"))
    return body.split("pretrain_gpt.py", 1)[1]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_megatron_args_parse_back_to_the_recipe(path):
    cfg = load_recipe(path)
    command = format_megatron_command(cfg, prepare_hint="python tools/prepare_data.py x")
    parser = _megatron_lm_parser()
    parser.add_argument("--window-attn-skip-freq", type=int, default=None)  # an int in the shipped recipes
    a = parser.parse_args(shlex.split(_command_argv(command)))  # unknown flags would exit here
    m, d, t, o, c = cfg.model, cfg.data, cfg.train, cfg.optimizer, cfg.checkpoint
    assert (a.window_size, a.window_attn_skip_freq) == (m.window_size and tuple(m.window_size), m.window_attn_skip_freq)
    structure = (m.multi_latent_attention, m.num_moe_experts is not None, m.qk_layernorm)
    spec = {(False, False, False): {"local": "hcp_local_spec", "te": "hcp_te_spec"}[m.layer_spec],
            (False, True, False): "hcp_moe_local_spec", (True, True, True): "hcp_mla_moe_local_spec",
            (False, False, True): "hcp_qknorm_local_spec", (False, True, True): "hcp_qknorm_moe_local_spec"}[structure]
    assert a.spec == ["mcp_context.megatron.specs", spec]
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads) == (
        m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads)
    assert a.group_query_attention == (m.num_query_groups is not None)
    assert a.num_query_groups == m.num_query_groups
    assert a.seq_length == m.seq_length and a.max_position_embeddings == (m.max_position_embeddings or m.seq_length)
    assert a.position_embedding_type == "rope" and a.rotary_base == m.rotary_base
    assert a.use_rope_scaling == m.rope_scaling
    assert a.normalization == "RMSNorm" and a.norm_epsilon == m.layernorm_epsilon
    assert (a.swiglu, a.quick_geglu) == (m.activation_func == "silu", m.activation_func == "quick_gelu")
    assert a.disable_bias_linear == (not m.add_bias_linear) and a.untie_embeddings_and_output_weights
    assert (a.softmax_type, a.qk_layernorm, a.multi_latent_attention) == (m.softmax_type, m.qk_layernorm,
                                                                          m.multi_latent_attention)
    if m.multi_latent_attention:
        assert (a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim, a.v_head_dim, a.rope_type) == (
            m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.rope_type)
        assert (a.rotary_scaling_factor, a.mscale, a.mscale_all_dim) == (m.rotary_scaling_factor, m.mscale,
                                                                         m.mscale_all_dim)
    assert a.num_experts == m.num_moe_experts
    if m.num_moe_experts is not None:
        assert (a.moe_router_topk, a.moe_ffn_hidden_size, a.moe_shared_expert_intermediate_size) == (
            m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size)
        assert (a.moe_router_score_function, a.moe_router_pre_softmax, a.moe_router_enable_expert_bias) == (
            m.moe_router_score_function, m.moe_router_pre_softmax, m.moe_router_enable_expert_bias)
        assert (a.moe_router_num_groups, a.moe_router_group_topk, a.moe_router_topk_scaling_factor) == (
            m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk_scaling_factor)
        assert a.moe_router_load_balancing_type == [m.moe_router_load_balancing_type]
    assert (a.glu_linear_offset or 0.0, a.activation_func_clamp_value) == (m.glu_linear_offset,
                                                                           m.activation_func_clamp_value)
    assert a.tensor_model_parallel_size == m.tensor_model_parallel_size
    assert a.pipeline_model_parallel_size == m.pipeline_model_parallel_size
    assert a.num_virtual_stages_per_pipeline_rank == m.virtual_pipeline_model_parallel_size
    assert a.context_parallel_size == m.context_parallel_size
    assert a.cp_comm_type == [m.cp_comm_type]
    assert a.hierarchical_context_parallel_sizes == m.hierarchical_context_parallel_sizes
    assert a.sequence_parallel == m.sequence_parallel and a.bf16 == m.bf16
    assert a.transformer_impl == {"local": "local", "te": "transformer_engine"}[m.layer_spec]
    assert a.recompute_granularity == m.recompute_granularity
    assert (a.micro_batch_size, a.global_batch_size, a.train_iters) == (t.micro_batch_size, t.global_batch_size, t.steps)
    assert (a.lr, a.min_lr, a.lr_warmup_iters, a.lr_decay_style) == (o.lr, o.min_lr, t.lr_warmup_iters, t.lr_decay_style)
    assert a.lr_decay_iters == (t.lr_decay_iters or t.steps)
    assert (a.weight_decay, a.adam_beta2, a.clip_grad) == (o.weight_decay, o.adam_beta2, o.clip_grad)
    assert a.use_distributed_optimizer == o.use_distributed_optimizer
    assert (a.save, a.load, a.save_interval) == (c.save, c.load, c.save_interval)
    assert a.tokenizer_type == TOKENIZER_TYPES[d.tokenizer_type] and a.split == megatron_split(cfg)[0]
    assert a.no_create_attention_mask_in_dataloader == (not d.create_attention_mask)
    if d.data_path:
        assert a.data_path == d.data_path and a.tokenizer_model == d.tokenizer_model
        assert "prepare_data" not in command
    else:
        assert a.data_path[0].endswith("_text_document") and a.tokenizer_model.endswith(".model")
        assert "# Tokenise the corpus first: python tools/prepare_data.py x" in command
    nproc = int(command.split("--nproc-per-node ")[1].split()[0])
    nnodes = int(command.split("--nnodes ")[1].split()[0]) if "--nnodes" in command else 1
    assert nproc * nnodes == t.world_size


@pytest.mark.parametrize("argv", [["show", "-"], ["validate", "-"],
                                  ["validate", str(RECIPES_DIR / "llama3_8b_128k_hcp.yaml"), "--world-size", "64"]])
def test_recipe_show_and_validate_import_neither_megatron_core_nor_torch(argv):
    """Importing megatron-core takes seconds (4.7 s of a 9 s run, seen); these commands need neither it
    nor torch, so they answer in a fraction of a second. Run in a fresh interpreter: this one has both."""
    script = ("import sys\nfrom mcp_context.recipes.__main__ import main\nstatus = main(sys.argv[1:])\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'torch'}))\nsys.exit(status)")
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120,
                          cwd=RECIPES_DIR.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout[-500:]


def test_cli_reports_bad_recipes_with_status_2(tmp_path, capsys):
    assert recipes_cli(["validate", str(RECIPES_DIR / "tiny_cpu.yaml"), "model.seq_length=250"]) == 2
    assert "error: model.seq_length 250 is not divisible by 2*cp=8" in capsys.readouterr().err
    assert recipes_cli(["validate", str(RECIPES_DIR / "llama3_8b_128k_hcp.yaml")]) == 0
    assert capsys.readouterr().out.startswith("OK llama3_8b_128k_hcp: TP4 PP2 CP8 (a2a+p2p, levels [2, 4])")
    assert recipes_cli(["show", "-", "train.steps=30"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["steps"] == 30
    from mcp_context.megatron_lm.__main__ import main as megatron_lm_cli

    assert megatron_lm_cli([str(RECIPES_DIR / "llama3_70b_1m_hcp.yaml"), "model.context_parallel_size=32",
                            "model.hierarchical_context_parallel_sizes=[2,16]", "train.world_size=1024"]) == 0
    out = capsys.readouterr().out
    assert "--context-parallel-size 32" in out and "--hierarchical-context-parallel-sizes 2 16" in out
    assert "--spec mcp_context.megatron.specs hcp_te_spec" in out and "--nnodes 128" in out


def test_spec_flag_names_a_module_spec_that_megatron_lm_can_import():
    """Megatron-LM's ``--spec MODULE NAME`` does ``getattr(import_module(MODULE), NAME)``."""
    import importlib

    from megatron.core.transformer.spec_utils import ModuleSpec

    argv = shlex.split(_command_argv(format_megatron_command(load_recipe(RECIPES_DIR / "tiny_cpu.yaml"))))
    module, name = argv[argv.index("--spec") + 1 : argv.index("--spec") + 3]
    assert isinstance(getattr(importlib.import_module(module), name), ModuleSpec)
