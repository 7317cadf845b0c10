"""Recipe checks that ``recipes validate`` used to miss: every numeric field has a range, the
launcher's recipe checks run in ``validate`` too, YAML keys are unique, a name is a plain name, and
the commands of docs/recipes.md run as written.
"""
from __future__ import annotations

import dataclasses
import shlex
import typing
from pathlib import Path

import pytest

from mcp_context.recipes import RecipeConfig, RecipeError, load_recipe, validate_recipe
from mcp_context.recipes.__main__ import main as recipes_cli
from mcp_context.recipes import RANGES

REPO = Path(__file__).resolve().parent.parent

# Each value the issue lists (and its neighbours), with the range the message must state.
OUT_OF_RANGE = [
    ("model.hidden_dropout=1.5", "model.hidden_dropout=1.5 must be a finite number with 0 <= model.hidden_dropout < 1"),
    ("model.attention_dropout=-0.1", "model.attention_dropout=-0.1 must be a finite number with 0 <= model.attention_dropout < 1"),
    ("model.kv_channels=0", "model.kv_channels=0 must be a positive integer"),
    ("model.kv_channels=-8", "model.kv_channels=-8 must be a positive integer"),
    ("model.num_query_groups=0", "model.num_query_groups=0 must be a positive integer"),
    ("model.make_vocab_size_divisible_by=0", "model.make_vocab_size_divisible_by=0 must be a positive integer"),
    ("model.layernorm_epsilon=-1e-5", "model.layernorm_epsilon=-1e-05 must be a finite number with 0 < model.layernorm_epsilon < 1"),
    ("model.rotary_percent=0", "model.rotary_percent=0.0 must be a finite number with 0 < model.rotary_percent <= 1"),
    ("model.hierarchical_context_parallel_sizes=[0, 4]",
     "model.hierarchical_context_parallel_sizes[0]=0 must be a positive integer"),
    ("model.window_size=[-2, 0]",
     "model.window_size[0]=-2 must be an integer with model.window_size[0] >= -1 (-1: unbounded on that side)"),
    ("model.window_attn_skip_freq=[1, -1]",
     "model.window_attn_skip_freq[1]=-1 must be a non-negative integer (an int n >= 1: each n-th layer attends"),
    ("optimizer.adam_eps=-1e-8", "optimizer.adam_eps=-1e-08 must be a finite number with 0 < optimizer.adam_eps < 1"),
    ("optimizer.clip_grad=-1", "optimizer.clip_grad=-1.0 must be a finite number with optimizer.clip_grad >= 0"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1 must be a finite number with optimizer.weight_decay >= 0"),
    ("optimizer.adam_beta1=2", "optimizer.adam_beta1=2.0 must be a finite number with 0 <= optimizer.adam_beta1 < 1"),
    ("optimizer.adam_beta2=1.0", "optimizer.adam_beta2=1.0 must be a finite number with 0 <= optimizer.adam_beta2 < 1"),
    ("optimizer.lr=inf", "optimizer.lr=inf must be a finite number with optimizer.lr > 0"),
    ("optimizer.lr=.nan", "optimizer.lr=nan must be a finite number with optimizer.lr > 0"),
    ("optimizer.lr=0", "optimizer.lr=0.0 must be a finite number with optimizer.lr > 0"),
    ("data.split=nan,1,1", "data.split='nan,1,1' must be up to three non-negative train,valid,test weights (finite"),
    ("data.split=inf,1,1", "data.split='inf,1,1' must be up to three non-negative train,valid,test weights (finite"),
    ("data.seed=-1", "data.seed=-1 must be an integer with 0 <= data.seed <= 4294967295"),
    ("data.tokenizer_vocab_size=100", "data.tokenizer_vocab_size=100 must be an integer with data.tokenizer_vocab_size >= 262"),
    (f"train.steps={10**30}", f"train.steps={10**30} must be an integer with 1 <= train.steps <= 100000000"),
    ("train.eval_iters=-1", "train.eval_iters=-1 must be a non-negative integer"),
    ("train.eval_interval=0", "train.eval_interval=0 must be a positive integer"),
    ("train.lr_warmup_iters=-1", "train.lr_warmup_iters=-1 must be a non-negative integer"),
    ("checkpoint.save_interval=0", "checkpoint.save_interval=0 must be a positive integer"),
    ("logging.log_interval=0", "logging.log_interval=0 must be a positive integer"),
]


@pytest.mark.parametrize("override, message", OUT_OF_RANGE, ids=[o for o, _ in OUT_OF_RANGE])
def test_validate_refuses_out_of_range_values_naming_key_value_and_range(capsys, override, message):
    with pytest.raises(RecipeError) as err:
        validate_recipe(load_recipe(None, [override]))
    assert message in str(err.value)
    assert recipes_cli(["validate", "-", override]) == 2  # the command line says the same
    assert message in capsys.readouterr().err


def _numeric_fields(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for name, annotation in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(annotation):
            keys += _numeric_fields(annotation, f"{name}.")
            continue
        args = typing.get_args(annotation) or (annotation,)
        inner = [a for arg in args for a in (typing.get_args(arg) or (arg,))]
        if any(a in (int, float) for a in inner):
            keys.append(prefix + name)
    return keys


def test_every_numeric_field_has_a_range():
    assert sorted(_numeric_fields(RecipeConfig)) == sorted(RANGES)


def test_the_shipped_defaults_sit_inside_every_range():
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        validate_recipe(load_recipe(path))


@pytest.mark.parametrize("overrides, message", [
    (["model.window_attn_skip_freq=2"], "model.window_attn_skip_freq=2 picks the sliding-window layers, but "
                                        "model.window_size is null; set model.window_size"),
    (["model.window_size=[7, 0]", "model.window_attn_skip_freq=0"],
     "model.window_attn_skip_freq=0 must be an integer n >= 1 (every n-th layer attends in full)"),
    (["model.window_size=[7, 0]", "model.window_attn_skip_freq=[0, 1, 1]"],
     "model.window_attn_skip_freq=[0, 1, 1] must hold one 0 (full attention) or 1 (window) per layer: "
     "model.num_layers=2 entries"),
    (["model.window_size=[7, 0]", "model.window_attn_skip_freq=[0, 2]"],
     "model.window_attn_skip_freq=[0, 2] must hold one 0 (full attention) or 1 (window) per layer"),
])
def test_window_layers_are_checked_as_megatron_core_reads_them(overrides, message):
    """``window_attn_skip_freq`` divides the layer number (an int) or is indexed by it (a list), and
    only means something with a window: each misuse is refused naming the key and the fix."""
    with pytest.raises(RecipeError) as err:
        validate_recipe(load_recipe(None, overrides))
    assert message in str(err.value)
    for freq in ("2", "[0, 1]", "null"):
        validate_recipe(load_recipe(None, ["model.window_size=[7, 0]", f"model.window_attn_skip_freq={freq}"]))


MLA = ["model.multi_latent_attention=true", "model.num_query_groups=null", "model.qk_layernorm=true"]
MOE = ["model.num_moe_experts=4"]


@pytest.mark.parametrize("overrides, message", [
    (["model.q_lora_rank=32"], "model.q_lora_rank=32 has no effect without model.multi_latent_attention=true; set "
                               "model.multi_latent_attention=true or remove model.q_lora_rank"),
    (["model.moe_router_topk=4"], "model.moe_router_topk=4 has no effect without model.num_moe_experts"),
    (["model.multi_latent_attention=true"], "model.num_query_groups=2: multi-latent attention has one key/value head "
                                            "per query head"),
    (MLA + ["model.kv_channels=16"], "model.kv_channels=16: multi-latent attention takes its head dims from "
                                     "model.qk_head_dim + model.qk_pos_emb_head_dim (query/key) and model.v_head_dim"),
    (MLA + ["model.rope_scaling=true"], "multi-latent attention applies RoPE itself (model.rope_type)"),
    (MLA + ["model.qk_pos_emb_head_dim=7"], "model.qk_pos_emb_head_dim=7 must be even"),
    (MLA + ["model.rope_type=rope", "model.mscale_all_dim=1.0"],
     "model.mscale_all_dim=1.0 has no effect without model.rope_type=yarn"),
    (MLA + ["model.v_head_dim=0"], "model.v_head_dim=0 must be a positive integer"),
    (["model.gated_linear_unit=false", "model.activation_func=gelu", "model.glu_linear_offset=1.0"],
     "model.glu_linear_offset=1.0 applies to a gated MLP only"),
    (["model.activation_func_clamp_value=0.0"], "model.activation_func_clamp_value=0.0 must be a finite number with "
                                                "model.activation_func_clamp_value > 0"),
    (MOE + ["model.moe_router_topk=5"], "model.moe_router_topk=5 is more than model.num_moe_experts=4"),
    (MOE + ["model.moe_layer_freq=0"], "model.moe_layer_freq=0 must be an integer n >= 1"),
    (MOE + ["model.moe_layer_freq=[1, 1, 0]"], "model.moe_layer_freq=[1, 1, 0] must hold one 0 (dense) or 1 (MoE) "
                                               "per layer: model.num_layers=2 entries"),
    (MOE + ["model.moe_router_enable_expert_bias=true"], "model.moe_router_enable_expert_bias=true needs "
                                                         "model.moe_router_score_function=sigmoid"),
    (MOE + ["model.moe_router_num_groups=2"], "group-limited routing needs both"),
    (MOE + ["model.moe_router_num_groups=3", "model.moe_router_group_topk=1"], "the groups must divide "
                                                                                "model.num_moe_experts=4"),
    (MOE + ["model.moe_router_num_groups=2", "model.moe_router_group_topk=1", "model.moe_router_topk=3"],
     "model.moe_router_topk=3 is more than the 2 experts of model.moe_router_group_topk=1 groups of 2"),
])
def test_attention_and_mlp_variants_are_checked_naming_the_key(overrides, message):
    """Sinks, MLA and MoE fields: a value megatron-core would assert on, or one that would be silently
    ignored (a feature's field without the feature), is refused naming the key and the fix."""
    with pytest.raises(RecipeError) as err:
        validate_recipe(load_recipe(None, overrides))
    assert message in str(err.value)


def test_the_variant_fields_in_valid_combinations_pass():
    for overrides in (["model.softmax_type=off-by-one"], ["model.softmax_type=learnable", "model.window_size=[7, 0]",
                                                         "model.window_attn_skip_freq=2"],
                      MLA + ["model.q_lora_rank=null", "model.rope_type=rope"], MLA + MOE,
                      MOE + ["model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
                             "model.moe_router_num_groups=2", "model.moe_router_group_topk=1",
                             "model.moe_router_topk_scaling_factor=2.5", "model.moe_layer_freq=[0, 1]"],
                      ["model.activation_func=quick_gelu", "model.glu_linear_offset=1.0",
                       "model.activation_func_clamp_value=7.0"]):
        validate_recipe(load_recipe(None, overrides))


def test_our_entry_takes_dense_layers_among_moe_ones():
    """The pretrain entry builds them with the per-layer block spec (get_gpt_decoder_block_hcp_spec)."""
    from mcp_context.pretrain.launch import check_recipe_for_training

    check_recipe_for_training(load_recipe(None, MOE + ["model.moe_layer_freq=[0, 1]", "train.device=cpu"]), 4)


def test_checkpoint_paths_that_are_files_are_refused(tmp_path):
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("x")
    with pytest.raises(RecipeError, match=rf"checkpoint.save='{a_file}' is an existing file, not a directory"):
        validate_recipe(load_recipe(None, [f"checkpoint.save={a_file}"]))
    with pytest.raises(RecipeError, match=rf"checkpoint.load='{a_file}/ckpt' is inside {a_file}, which is an existing file"):
        validate_recipe(load_recipe(None, [f"checkpoint.load={a_file}/ckpt"]))
    validate_recipe(load_recipe(None, [f"checkpoint.save={tmp_path}/new/checkpoints"]))  # missing dirs are fine


@pytest.mark.parametrize("override, key", [
    ("train.eval_iters=-1", "train.eval_iters"),
    ("checkpoint.save_interval=0", "checkpoint.save_interval"),
    ("train.lr_decay_style=WSD", "train.lr_decay_style"),
    ("checkpoint.save=/dev/null", "checkpoint.save"),
])
def test_what_the_launcher_refuses_validate_refuses(override, key):
    """``recipes validate`` and the pretrain launcher run the same recipe checks."""
    from mcp_context.pretrain.launch import check_recipe_for_training

    cfg = load_recipe(None, [override])
    with pytest.raises(RecipeError) as by_validate:
        validate_recipe(cfg, world_size=4)
    with pytest.raises(RecipeError) as by_launcher:
        check_recipe_for_training(cfg, world_size=4)
    assert str(by_validate.value) == str(by_launcher.value) and key in str(by_validate.value)


def test_duplicate_yaml_keys_are_refused_naming_key_and_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  steps: 10\n  micro_batch_size: 2\n  steps: 1000\n")
    with pytest.raises(RecipeError, match=rf"recipe {path}: key 'steps' at line 4 repeats the key at line 2"):
        load_recipe(path)
    path.write_text("model:\n  num_layers: 2\nmodel:\n  num_layers: 4\n")
    with pytest.raises(RecipeError, match=r"key 'model' at line 3 repeats the key at line 1"):
        load_recipe(path)
    path.write_text("model:\n  num_layers: 2\ntrain:\n  steps: 10\n")  # the same key in two sections is fine
    assert load_recipe(path).train.steps == 10


@pytest.mark.parametrize("name", ["../escape", "a/b", "/abs", "x..y", ".hidden", "", "two words"])
def test_recipe_name_must_be_a_plain_name(name):
    with pytest.raises(RecipeError, match=r"name=.* must be a plain name .* runs/<name> is derived from it"):
        validate_recipe(load_recipe(None, [f"name={name!r}" if name else "name=''"]))


def test_recipe_name_accepts_plain_names():
    for name in ("tiny_cpu", "llama3.1-8b_128k", "Run2"):
        validate_recipe(load_recipe(None, [f"name={name}"]))


def _documented_recipe_commands() -> list[list[str]]:
    """``[module, *args]`` of each line of docs/recipes.md's command-line block."""
    text = (REPO / "docs" / "recipes.md").read_text()
    block = text.split("## Command line", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.strip().splitlines():
        argv = shlex.split(line, comments=True)
        assert argv[:2] == ["python", "-m"] and argv[2] in ("mcp_context.recipes", "mcp_context.megatron_lm"), line
        commands.append(argv[2:3] + [str(REPO / a) if a.endswith(".yaml") else a for a in argv[3:]])
    return commands


@pytest.mark.parametrize("argv", _documented_recipe_commands(), ids=lambda a: " ".join(a[:2] + a[3:]))
def test_documented_recipe_commands_run_as_written(argv, capsys):
    from mcp_context.megatron_lm.__main__ import main as megatron_lm_cli

    main = {"mcp_context.recipes": recipes_cli, "mcp_context.megatron_lm": megatron_lm_cli}[argv[0]]
    assert main(argv[1:]) == 0, capsys.readouterr().err


GRAPHS = ["model.cp_step_graphs=true", "model.cp_comm_type=a2a", "model.hierarchical_context_parallel_sizes=null",
          "train.device=cuda"]


@pytest.mark.parametrize("overrides, message", [
    (["model.cp_step_graphs=true", "train.device=cpu"], "model.cp_step_graphs=true with train.device='cpu': CUDA "
                                                        "graphs replay on a CUDA device; set train.device=cuda"),
    (["model.cp_step_graphs=true", "train.device=cuda"], "model.cp_step_graphs=true with model.cp_comm_type='a2a+p2p': "
                                                         "its ring moves K/V between ranks inside the step"),
    (GRAPHS[:1] + ["model.cp_comm_type=p2p", "model.hierarchical_context_parallel_sizes=null", "train.device=cuda"],
     "model.cp_step_graphs=true with model.cp_comm_type='p2p'"),
    (GRAPHS + ["model.attention_dropout=0.1"], "model.cp_step_graphs=true with model.attention_dropout=0.1: dropout "
                                               "draws a new mask per call; set it to 0; or set model.cp_step_graphs=false"),
    (GRAPHS + ["data.reset_attention_mask=true"], "model.cp_step_graphs=true with data.reset_attention_mask=true: "
                                                  "packed documents change from batch to batch"),
])
def test_step_graphs_are_refused_where_the_engine_cannot_replay_naming_the_key(overrides, message):
    """``model.cp_step_graphs``: a device, comm type, dropout or packing the engine would refuse at its first call
    is refused before a launch, naming the key and the fix."""
    with pytest.raises(RecipeError) as err:
        validate_recipe(load_recipe(None, overrides))
    assert message in str(err.value)


def test_step_graphs_pass_where_the_engine_replays_and_reach_the_spec(monkeypatch):
    """a2a, all_gather and a2a+all_gather on CUDA, and any comm at CP 1, validate; the spec our entry builds
    carries the choice to the core attention (the printed Megatron-LM command refuses it:
    tests/test_recipes_megatron_lm.py's REFUSED) and a launch whose train.device=auto resolves to the CPU (CUDA hidden here, as on CI) refuses it
    naming the key."""
    import torch

    from mcp_context.pretrain.launch import check_recipe_for_training
    from mcp_context.recipes.schema import decoder_spec

    for comm in (["model.cp_comm_type=a2a", "model.hierarchical_context_parallel_sizes=null"],
                 ["model.cp_comm_type=all_gather", "model.hierarchical_context_parallel_sizes=null"],
                 ["model.cp_comm_type=a2a+all_gather"],
                 ["model.context_parallel_size=1", "model.cp_comm_type=p2p",
                  "model.hierarchical_context_parallel_sizes=null"]):
        validate_recipe(load_recipe(None, GRAPHS[:1] + comm + ["train.device=cuda"]))
    cfg = load_recipe(None, GRAPHS)
    spec = decoder_spec(cfg.model, None)
    assert spec.submodules.self_attention.submodules.core_attention.params["step_graphs"] is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RecipeError, match=r"model.cp_step_graphs=true replays the attention step from CUDA graphs, "
                                          r"and this run trains on the CPU \(train.device\)"):
        check_recipe_for_training(load_recipe(None, GRAPHS[:-1] + ["train.device=auto", "train.world_size=4"]), 4)
