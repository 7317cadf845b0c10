"""``python -m mcp_context.megatron_lm`` prints a command that runs as printed: a local-impl recipe turns off the
fusions that need Transformer Engine or apex, and a split Megatron-LM's dataset builder would loop
on is refused (empty train/valid) or adjusted with a note (empty test). (That the Megatron-LM
translation sits above ``data``, which sits above ``recipes``, is tests/test_layering.py's check.)
"""
from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from mcp_context.megatron_lm import LOCAL_IMPL_FLAGS, format_megatron_command, megatron_split
from mcp_context.recipes import RecipeError, load_recipe, validate_recipe
from mcp_context.megatron_lm.__main__ import main as megatron_lm_cli
from tests.test_recipes import _command_argv, _megatron_lm_parser

REPO = Path(__file__).resolve().parent.parent


def _parsed(command: str):
    return _megatron_lm_parser().parse_args(shlex.split(_command_argv(command)))


def test_local_recipe_command_runs_without_te_or_apex(capsys):
    assert megatron_lm_cli([str(REPO / "recipes" / "tiny_cpu.yaml")]) == 0
    command = capsys.readouterr().out
    a = _parsed(command)
    assert a.transformer_impl == "local" and a.spec == ["mcp_context.megatron.specs", "hcp_local_spec"]
    assert (a.apply_rope_fusion, a.persist_layer_norm, a.gradient_accumulation_fusion) == (False, False, False)
    # The bundled corpus has 236 scenes: 949,50,1 leaves the test split empty, so the test weight goes.
    assert a.split == "949,50,0"
    assert ("# data.split='949,50,1' leaves the test split of" in command and "(236 documents) empty" in command
            and "printed --split 949,50,0 (no test set)" in command)


def test_te_recipe_keeps_megatron_lm_fusions():
    cfg = load_recipe(REPO / "recipes" / "llama3_8b_128k_hcp.yaml")
    command = format_megatron_command(cfg)
    a = _parsed(command)
    assert a.transformer_impl == "transformer_engine" and a.apply_rope_fusion and a.gradient_accumulation_fusion
    assert not any(flag in command for flag in LOCAL_IMPL_FLAGS)
    assert a.split == cfg.data.split == "99,1,0"  # data on the cluster: document counts unknown, split as given


@pytest.mark.parametrize("split, name", [("999,1,0", "valid"), ("1,999,0", "train")])
def test_a_split_with_an_empty_train_or_valid_set_is_refused(split, name, capsys):
    cfg = load_recipe(None, [f"data.split={split}"])
    with pytest.raises(RecipeError, match=rf"data.split='{split}' leaves the {name} split of .* \(236 documents\) "
                                          rf"with no document, which megatron-core's dataset builder loops on forever"):
        megatron_split(cfg)
    assert megatron_lm_cli(["-", f"data.split={split}"]) == 2
    assert f"error: data.split='{split}' leaves the {name} split" in capsys.readouterr().err


def test_a_split_with_documents_everywhere_is_printed_unchanged():
    cfg = load_recipe(None, ["data.split=90,8,2"])
    assert megatron_split(cfg) == ("90,8,2", None)
    assert _parsed(format_megatron_command(cfg)).split == "90,8,2"




def test_a_float_rotary_base_prints_as_megatron_lms_integer_or_is_refused():
    """``model.rotary_base`` takes a float (a converted model's ``rope_theta``); Megatron-LM's
    ``--rotary-base`` takes an integer, so a whole float prints as one and a fraction is refused."""
    a = _parsed(format_megatron_command(load_recipe(None, ["model.rotary_base=5.0e+5"])))
    assert a.rotary_base == 500000
    with pytest.raises(RecipeError, match=r"model.rotary_base=10000.5 has no Megatron-LM spelling"):
        format_megatron_command(load_recipe(None, ["model.rotary_base=10000.5"]))


def test_a_sliding_window_recipe_prints_megatron_lms_window_size():
    """``model.window_size`` reaches Megatron-LM as ``--window-size left,right`` (its ``tuple_type``)."""
    cfg = load_recipe(None, ["model.window_size=[63, 0]"])
    validate_recipe(cfg)
    assert _parsed(format_megatron_command(cfg)).window_size == (63, 0)
    assert _parsed(format_megatron_command(load_recipe(None))).window_size is None


def _megatron_lm_freq(x: str):
    """Megatron-LM's ``moe_freq_type`` (``--window-attn-skip-freq``'s parser): an int, or a list
    expression of digits, commas, brackets, parentheses, ``+`` and ``*`` only, which it evaluates
    (a plain list literal here)."""
    if "[" not in x:
        return int(x)
    assert not re.search(r"[^,\d\[\]\(\)\+\*]", x), f"Megatron-LM refuses the pattern {x!r}"
    return ast.literal_eval(x)


@pytest.mark.parametrize("freq", [2, [0, 1]])
def test_window_attn_skip_freq_prints_as_megatron_lms_flag(freq):
    """``model.window_attn_skip_freq`` reaches Megatron-LM as ``--window-attn-skip-freq``: an int as
    it is, a list as the list expression its parser evaluates (no spaces, which it refuses)."""
    cfg = load_recipe(None, ["model.window_size=[7, 0]", f"model.window_attn_skip_freq={freq}"])
    validate_recipe(cfg)
    parser = _megatron_lm_parser()
    parser.add_argument("--window-attn-skip-freq", type=_megatron_lm_freq, default=None)
    args = parser.parse_args(shlex.split(_command_argv(format_megatron_command(cfg))))
    assert (args.window_size, args.window_attn_skip_freq) == ((7, 0), freq)
    assert "--window-attn-skip-freq" not in format_megatron_command(load_recipe(None, ["model.window_size=[7, 0]"]))


# ---- every recipe field: printed as its flag, listed as ours only, or refused --------------------------------------

MLA = ["model.multi_latent_attention=true", "model.num_query_groups=null", "model.qk_layernorm=true"]
MOE = ["model.num_moe_experts=4"]
YARN = ["model.position_embedding_type=yarn"]

HYBRID = ["model.hybrid_context_parallel=true", "model.max_seqlen_per_dp_cp_rank=64", "model.context_parallel_size=1",
          "model.hierarchical_context_parallel_sizes=null", "model.cp_comm_type=p2p", "data.reset_attention_mask=true"]
"""The tiny recipe with dynamic CP as Megatron-LM can run it: flat p2p groups over 4 data parallel ranks."""


# dotted field -> (the parsed Megatron-LM argument it becomes, overrides that change it, the value it then has).
# A field new to the schema fails test_every_recipe_field_has_a_verdict until it gets a row here or in OUR_ENTRY_ONLY.
PRINTED = {
    "model.num_layers": ("num_layers", ["model.num_layers=4"], 4),
    "model.hidden_size": ("hidden_size", ["model.hidden_size=128"], 128),
    "model.ffn_hidden_size": ("ffn_hidden_size", ["model.ffn_hidden_size=null"], 256),  # 4 x hidden, as ours
    "model.num_attention_heads": ("num_attention_heads", ["model.num_attention_heads=8"], 8),
    "model.num_query_groups": ("num_query_groups", ["model.num_query_groups=1"], 1),
    "model.kv_channels": ("kv_channels", ["model.kv_channels=32"], 32),
    "model.seq_length": ("seq_length", ["model.seq_length=512"], 512),
    "model.max_position_embeddings": ("max_position_embeddings", ["model.max_position_embeddings=1024"], 1024),
    "model.vocab_size": ("make_vocab_size_divisible_by", ["model.vocab_size=4224"], 4224),
    "model.make_vocab_size_divisible_by": ("make_vocab_size_divisible_by", ["model.make_vocab_size_divisible_by=64"], 64),
    "model.position_embedding_type": ("position_embedding_type", ["model.position_embedding_type=learned_absolute"],
                                      "learned_absolute"),
    "model.rotary_base": ("rotary_base", ["model.rotary_base=500000"], 500000),
    "model.rotary_percent": ("rotary_percent", ["model.rotary_percent=0.5"], 0.5),
    "model.rope_scaling": ("use_rope_scaling", ["model.rope_scaling=true"], True),
    "model.rope_scaling_factor": ("rope_scaling_factor", ["model.rope_scaling=true", "model.rope_scaling_factor=16.0"],
                                  16.0),
    "model.yarn_rotary_scaling_factor": ("rotary_scaling_factor", YARN + ["model.yarn_rotary_scaling_factor=32.0"],
                                         32.0),
    "model.yarn_original_max_position_embeddings": ("yarn_original_max_position_embeddings", YARN + [
        "model.yarn_original_max_position_embeddings=8192"], 8192),
    "model.yarn_beta_fast": ("yarn_beta_fast", YARN + ["model.yarn_beta_fast=16.0"], 16.0),
    "model.yarn_beta_slow": ("yarn_beta_slow", YARN + ["model.yarn_beta_slow=2.0"], 2.0),
    "model.yarn_mscale": ("mscale", YARN + ["model.yarn_mscale=0.7"], 0.7),
    "model.yarn_mscale_all_dim": ("mscale_all_dim", YARN + ["model.yarn_mscale_all_dim=1.0"], 1.0),
    "model.yarn_correction_range_round_to_int": ("yarn_correction_range_round_to_int", YARN + [
        "model.yarn_correction_range_round_to_int=false"], False),
    "model.share_embeddings_and_output_weights": ("untie_embeddings_and_output_weights",
                                                  ["model.share_embeddings_and_output_weights=true"], False),
    "model.normalization": ("normalization", ["model.normalization=LayerNorm"], "LayerNorm"),
    "model.layernorm_epsilon": ("norm_epsilon", ["model.layernorm_epsilon=1e-6"], 1e-6),
    "model.gated_linear_unit": ("swiglu", ["model.gated_linear_unit=false", "model.activation_func=gelu"], False),
    "model.activation_func": ("squared_relu", ["model.gated_linear_unit=false", "model.activation_func=squared_relu"],
                              True),
    "model.add_bias_linear": ("disable_bias_linear", ["model.add_bias_linear=true"], False),
    "model.add_qkv_bias": ("add_qkv_bias", ["model.add_qkv_bias=true"], True),
    "model.window_size": ("window_size", ["model.window_size=[7, 0]"], (7, 0)),
    "model.window_attn_skip_freq": ("window_attn_skip_freq", ["model.window_size=[7, 0]",
                                                              "model.window_attn_skip_freq=2"], 2),
    "model.softmax_type": ("softmax_type", ["model.softmax_type=learnable"], "learnable"),
    "model.qk_layernorm": ("qk_layernorm", ["model.qk_layernorm=true"], True),
    "model.glu_linear_offset": ("glu_linear_offset", ["model.glu_linear_offset=1.0"], 1.0),
    "model.activation_func_clamp_value": ("activation_func_clamp_value", ["model.activation_func_clamp_value=7.0"],
                                          7.0),
    "model.multi_latent_attention": ("multi_latent_attention", MLA, True),
    "model.q_lora_rank": ("q_lora_rank", MLA + ["model.q_lora_rank=32"], 32),
    "model.kv_lora_rank": ("kv_lora_rank", MLA + ["model.kv_lora_rank=64"], 64),
    "model.qk_head_dim": ("qk_head_dim", MLA + ["model.qk_head_dim=24"], 24),
    "model.qk_pos_emb_head_dim": ("qk_pos_emb_head_dim", MLA + ["model.qk_pos_emb_head_dim=16"], 16),
    "model.v_head_dim": ("v_head_dim", MLA + ["model.v_head_dim=16"], 16),
    "model.rope_type": ("rope_type", MLA + ["model.rope_type=rope"], "rope"),
    "model.rotary_scaling_factor": ("rotary_scaling_factor", MLA + ["model.rotary_scaling_factor=8.0"], 8.0),
    "model.mscale": ("mscale", MLA + ["model.mscale=0.7"], 0.7),
    "model.mscale_all_dim": ("mscale_all_dim", MLA + ["model.mscale_all_dim=1.0"], 1.0),
    "model.num_moe_experts": ("num_experts", MOE, 4),
    "model.moe_ffn_hidden_size": ("moe_ffn_hidden_size", MOE + ["model.moe_ffn_hidden_size=64"], 64),
    "model.moe_router_topk": ("moe_router_topk", MOE + ["model.moe_router_topk=1"], 1),
    "model.moe_shared_expert_intermediate_size": ("moe_shared_expert_intermediate_size",
                                                  MOE + ["model.moe_shared_expert_intermediate_size=64"], 64),
    "model.moe_router_score_function": ("moe_router_score_function", MOE + ["model.moe_router_score_function=sigmoid"],
                                        "sigmoid"),
    "model.moe_layer_freq": ("moe_layer_freq", MOE + ["model.moe_layer_freq=[0, 1]", "model.layer_spec=te"], [0, 1]),
    "model.moe_router_pre_softmax": ("moe_router_pre_softmax", MOE + ["model.moe_router_pre_softmax=true"], True),
    "model.moe_router_topk_scaling_factor": ("moe_router_topk_scaling_factor",
                                             MOE + ["model.moe_router_topk_scaling_factor=2.5"], 2.5),
    "model.moe_router_enable_expert_bias": ("moe_router_enable_expert_bias", MOE + [
        "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true"], True),
    "model.moe_router_num_groups": ("moe_router_num_groups", MOE + ["model.moe_router_num_groups=2",
                                                                    "model.moe_router_group_topk=1"], 2),
    "model.moe_router_group_topk": ("moe_router_group_topk", MOE + ["model.moe_router_num_groups=2",
                                                                    "model.moe_router_group_topk=1"], 1),
    "model.moe_router_load_balancing_type": ("moe_router_load_balancing_type",
                                             MOE + ["model.moe_router_load_balancing_type=none"], ["none"]),
    "model.moe_aux_loss_coeff": ("moe_aux_loss_coeff", MOE + ["model.moe_aux_loss_coeff=0.01"], [0.01]),
    "model.attention_dropout": ("attention_dropout", ["model.attention_dropout=0.1"], 0.1),
    "model.hidden_dropout": ("hidden_dropout", ["model.hidden_dropout=0.1"], 0.1),
    "model.init_method_std": ("init_method_std", ["model.init_method_std=0.01"], 0.01),
    "model.tensor_model_parallel_size": ("tensor_model_parallel_size", ["model.tensor_model_parallel_size=2"], 2),
    "model.pipeline_model_parallel_size": ("pipeline_model_parallel_size", ["model.pipeline_model_parallel_size=2"], 2),
    "model.virtual_pipeline_model_parallel_size": ("num_virtual_stages_per_pipeline_rank", [
        "model.num_layers=4", "model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"], 2),
    "model.context_parallel_size": ("context_parallel_size", ["model.context_parallel_size=2",
                                                              "model.hierarchical_context_parallel_sizes=null"], 2),
    "model.hierarchical_context_parallel_sizes": ("hierarchical_context_parallel_sizes",
                                                  ["model.hierarchical_context_parallel_sizes=[4, 1]"], [4, 1]),
    "model.cp_comm_type": ("cp_comm_type", ["model.cp_comm_type=p2p", "model.hierarchical_context_parallel_sizes=null"],
                           ["p2p"]),
    "model.hybrid_context_parallel": ("hybrid_context_parallel", HYBRID, True),
    "model.max_seqlen_per_dp_cp_rank": ("max_seqlen_per_dp_cp_rank", HYBRID, 64),
    "model.sequence_parallel": ("sequence_parallel", ["model.sequence_parallel=true"], True),
    "model.bf16": ("bf16", ["model.bf16=true", "model.params_dtype=bfloat16"], True),
    "model.params_dtype": ("fp16", ["model.params_dtype=float16"], True),
    "model.recompute_granularity": ("recompute_granularity", ["model.recompute_granularity=full"], "full"),
    "model.recompute_method": ("recompute_method", ["model.recompute_method=uniform"], "uniform"),
    "model.recompute_num_layers": ("recompute_num_layers", ["model.recompute_num_layers=1"], 1),
    "model.layer_spec": ("transformer_impl", ["model.layer_spec=te"], "transformer_engine"),
    "data.data_path": ("data_path", ["data.data_path=[/d/a_text_document]", "data.tokenizer_model=/t.model"],
                       ["/d/a_text_document"]),
    "data.tokenizer_type": ("tokenizer_type", ["data.data_path=[/d/a_text_document]", "data.tokenizer_model=/tok",
                                               "data.tokenizer_type=HuggingFaceTokenizer"], "HuggingFaceTokenizer"),
    "data.tokenizer_model": ("tokenizer_model", ["data.data_path=[/d/a_text_document]", "data.tokenizer_model=/t.model"],
                             "/t.model"),
    "data.split": ("split", ["data.split=90,8,2"], "90,8,2"),
    "data.cache_dir": ("data_cache_path", ["data.cache_dir=/tmp/mcp_cache"], "/tmp/mcp_cache"),
    "data.num_workers": ("num_workers", ["data.num_workers=2"], 2),
    "data.create_attention_mask": ("no_create_attention_mask_in_dataloader", ["data.create_attention_mask=true"], False),
    "data.reset_position_ids": ("reset_position_ids", ["data.reset_position_ids=true"], True),
    "data.reset_attention_mask": ("reset_attention_mask", ["data.reset_attention_mask=true"], True),
    "data.eod_mask_loss": ("eod_mask_loss", ["data.eod_mask_loss=true"], True),
    "data.seed": ("seed", ["data.seed=7", "train.seed=7"], 7),  # one seed; data.seed apart from train.seed: listed
    "train.steps": ("train_iters", ["train.steps=100"], 100),
    "train.global_batch_size": ("global_batch_size", ["train.global_batch_size=16"], 16),
    "train.micro_batch_size": ("micro_batch_size", ["train.micro_batch_size=1"], 1),
    "train.lr_warmup_iters": ("lr_warmup_iters", ["train.lr_warmup_iters=3"], 3),
    "train.lr_decay_iters": ("lr_decay_iters", ["train.lr_decay_iters=40"], 40),
    "train.lr_decay_style": ("lr_decay_style", ["train.lr_decay_style=linear"], "linear"),
    "train.eval_interval": ("eval_interval", ["train.eval_interval=10"], 10),
    "train.eval_iters": ("eval_iters", ["train.eval_iters=5"], 5),
    "train.seed": ("seed", ["train.seed=7", "data.seed=7"], 7),
    "optimizer.optimizer": ("optimizer", ["optimizer.optimizer=sgd"], "sgd"),
    "optimizer.lr": ("lr", ["optimizer.lr=1e-3"], 1e-3),
    "optimizer.min_lr": ("min_lr", ["optimizer.min_lr=1e-5"], 1e-5),
    "optimizer.weight_decay": ("weight_decay", ["optimizer.weight_decay=0.01"], 0.01),
    "optimizer.adam_beta1": ("adam_beta1", ["optimizer.adam_beta1=0.8"], 0.8),
    "optimizer.adam_beta2": ("adam_beta2", ["optimizer.adam_beta2=0.99"], 0.99),
    "optimizer.adam_eps": ("adam_eps", ["optimizer.adam_eps=1e-6"], 1e-6),
    "optimizer.clip_grad": ("clip_grad", ["optimizer.clip_grad=0.5"], 0.5),
    "optimizer.use_distributed_optimizer": ("use_distributed_optimizer", ["optimizer.use_distributed_optimizer=true"],
                                            True),
    "checkpoint.save": ("save", ["checkpoint.save=/ck/save"], "/ck/save"),
    "checkpoint.load": ("load", ["checkpoint.load=/ck/load"], "/ck/load"),
    "checkpoint.save_interval": ("save_interval", ["checkpoint.save_interval=10"], 10),
    "logging.log_interval": ("log_interval", ["logging.log_interval=5"], 5),
    "logging.tensorboard_dir": ("tensorboard_dir", ["logging.tensorboard_dir=/tb"], "/tb"),
    "logging.wandb_project": ("wandb_project", ["logging.wandb_project=proj"], "proj"),
}


def test_hybrid_cp_prints_megatron_lms_flags_or_is_refused_naming_what_it_cannot_express():
    """Flat p2p over 4 data parallel ranks prints megatron-core's hybrid CP flags with per-token loss; a hierarchy
    over the data parallel group, and a data parallel size whose groups are not all powers of two, are refused."""
    a = _parse_with_skip_freq(format_megatron_command(load_recipe(None, HYBRID)))
    assert (a.hybrid_context_parallel, a.max_seqlen_per_dp_cp_rank, a.calculate_per_token_loss,
            a.context_parallel_size, a.hierarchical_context_parallel_sizes) == (True, 64, True, 1, None)
    with pytest.raises(RecipeError, match=r"^model.hierarchical_context_parallel_sizes=\[2, 2\] with "
                                          r"model.hybrid_context_parallel=true has no Megatron-LM spelling"):
        format_megatron_command(load_recipe(None, HYBRID + ["model.hierarchical_context_parallel_sizes=[2, 2]",
                                                            "model.cp_comm_type=a2a+p2p"]))
    six = load_recipe(None, HYBRID + ["train.world_size=6", "model.max_seqlen_per_dp_cp_rank=48"])
    validate_recipe(six)  # our entry trains it (groups of 1, 2, 3, 6)
    with pytest.raises(RecipeError, match=r"^model.hybrid_context_parallel=true over 6 data parallel ranks has no "
                                          r"Megatron-LM spelling: our entry gives documents groups of \[1, 2, 3, 6\]"):
        format_megatron_command(six)


def _schema_fields() -> set[str]:
    import dataclasses

    from mcp_context.recipes import RecipeConfig

    fields = set()
    for f in dataclasses.fields(RecipeConfig):
        if dataclasses.is_dataclass(f.default_factory) if f.default_factory is not dataclasses.MISSING else False:
            fields |= {f"{f.name}.{g.name}" for g in dataclasses.fields(f.default_factory)}
        else:
            fields.add(f.name)
    return fields


def _parse_with_skip_freq(command: str):
    parser = _megatron_lm_parser()
    parser.add_argument("--window-attn-skip-freq", type=_megatron_lm_freq, default=None)
    return parser.parse_args(shlex.split(_command_argv(command)))


# dotted field -> overrides giving it a value Megatron-LM's flags cannot express (megatron_lm.REFUSED_UNLESS_DEFAULT).
REFUSED = {
    "model.original_max_position_embeddings": MLA + ["model.original_max_position_embeddings=8192"],
    "model.beta_fast": MLA + ["model.beta_fast=1.0"],  # Kimi K2's
    "model.beta_slow": MLA + ["model.beta_slow=2.0"],
    "model.cp_step_graphs": ["model.cp_step_graphs=true", "model.cp_comm_type=a2a",
                             "model.hierarchical_context_parallel_sizes=null", "train.device=cuda"],
}


def test_every_recipe_field_has_a_verdict():
    """Each schema field is printed as a flag (PRINTED), listed as our entry only (OUR_ENTRY_ONLY), or
    refused unless at its default (REFUSED_UNLESS_DEFAULT): exactly one of them."""
    from mcp_context.megatron_lm import OUR_ENTRY_ONLY, REFUSED_UNLESS_DEFAULT

    fields = _schema_fields()
    verdicts = [set(PRINTED), set(OUR_ENTRY_ONLY), set(REFUSED_UNLESS_DEFAULT)]
    assert sum(len(v) for v in verdicts) == len(set().union(*verdicts)), "a field with two verdicts"
    assert fields - set().union(*verdicts) == set(), "fields without a verdict"
    assert set().union(*verdicts) <= fields, "verdicts for fields the schema no longer has"
    assert set(REFUSED) == set(REFUSED_UNLESS_DEFAULT)


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_a_field_megatron_lm_cannot_express_is_refused_naming_it(field):
    cfg = load_recipe(None, REFUSED[field])
    validate_recipe(cfg)  # a valid recipe (our entry decides on its own whether it trains it)
    with pytest.raises(RecipeError, match=rf"^{re.escape(field)}=.*(no Megatron-LM spelling|every layer)"):
        format_megatron_command(cfg)


@pytest.mark.parametrize("field", sorted(PRINTED))
def test_a_printed_field_reaches_its_megatron_lm_flag(field):
    dest, overrides, expected = PRINTED[field]
    base = _parse_with_skip_freq(format_megatron_command(load_recipe(None)))
    changed = _parse_with_skip_freq(format_megatron_command(load_recipe(None, overrides)))
    assert getattr(changed, dest) == expected and getattr(base, dest) != expected, (getattr(base, dest),
                                                                                     getattr(changed, dest))


def test_our_entry_only_fields_are_listed_with_their_reason_in_the_comment_block():
    from mcp_context.megatron_lm import OUR_ENTRY_ONLY

    comments = [line for line in format_megatron_command(load_recipe(None)).splitlines() if line.startswith("#")]
    for key, why in OUR_ENTRY_ONLY.items():
        assert f"# {key}: our entry only: {why}" in comments
    assert not any(line.startswith("# data.seed") for line in comments)  # equal to train.seed: it is --seed
    apart = format_megatron_command(load_recipe(None, ["data.seed=7"]))
    assert "# data.seed=7: our entry only: Megatron-LM orders the data with --seed 1234" in apart


def _megatron_lm_padded_vocab(tokenizer_vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding`` (megatron/training/tokenizer/tokenizer.py)."""
    multiple = divisible_by * tp
    return -(-tokenizer_vocab // multiple) * multiple


@pytest.mark.parametrize("vocab_size, tp", [(None, 1), (None, 2), (4224, 1), (4224, 2), (128256, 8)])
@pytest.mark.parametrize("tokenizer_vocab", [4000, 4096, 4100])
def test_our_entry_and_the_printed_command_build_the_same_embedding(vocab_size, tp, tokenizer_vocab):
    """Our entry's rows (``padded_vocab_size``) equal Megatron-LM's padding of the tokenizer's size with
    the printed flags, for a tokenizer no larger than ``model.vocab_size`` (what the prepare step checks)."""
    overrides = [f"model.vocab_size={'null' if vocab_size is None else vocab_size}",
                 f"model.tensor_model_parallel_size={tp}"]
    cfg = load_recipe(None, overrides)
    a = _parsed(format_megatron_command(cfg))
    assert a.tensor_model_parallel_size == tp
    assert cfg.padded_vocab_size(tokenizer_vocab) == _megatron_lm_padded_vocab(tokenizer_vocab,
                                                                               a.make_vocab_size_divisible_by, tp)
    with pytest.raises(RecipeError, match=r"model.vocab_size=4225 is not divisible by model.tensor_model_parallel_size=2"):
        format_megatron_command(load_recipe(None, ["model.vocab_size=4225", "model.tensor_model_parallel_size=2"]))


def test_the_printed_sentencepiece_tokenizer_is_megatron_lms_gpt_one():
    """Ours is Megatron-LM's GPTSentencePieceTokenizer (pieces only, EOS ends a document); its
    SentencePieceTokenizer would add four ids and an <EOD> our tokenised data never holds."""
    assert _parsed(format_megatron_command(load_recipe(None))).tokenizer_type == "GPTSentencePieceTokenizer"


@pytest.mark.parametrize("bf16, params_dtype", [(False, "float32"), (True, "bfloat16"), (False, "float16"),
                                                (True, "float32"), (False, "bfloat16"), (True, "float16")])
def test_our_entry_and_the_printed_command_agree_on_precision_or_refuse(bf16, params_dtype):
    """Megatron-LM derives precision from its flags (arguments.py: params_dtype float32, half with --fp16,
    bfloat16 with --bf16); our TransformerConfig must say the same, and a combination no flag
    expresses (bf16 with fp32 or fp16 parameters, bf16 parameters without mixed precision) is refused."""
    import torch

    from mcp_context.recipes.schema import transformer_config_kwargs

    cfg = load_recipe(None, [f"model.bf16={str(bf16).lower()}", f"model.params_dtype={params_dtype}"])
    if (bf16, params_dtype) in ((True, "float32"), (False, "bfloat16"), (True, "float16")):
        for refuse in (lambda: format_megatron_command(cfg), lambda: validate_recipe(cfg),
                       lambda: transformer_config_kwargs(cfg.model)):
            with pytest.raises(RecipeError, match=rf"model.bf16={str(bf16).lower()} with "
                                                  rf"model.params_dtype='{params_dtype}': .*; set model"):
                refuse()
        return
    a = _parsed(format_megatron_command(cfg))
    theirs = (a.bf16, a.fp16, torch.bfloat16 if a.bf16 else torch.half if a.fp16 else torch.float32)
    ours = transformer_config_kwargs(cfg.model)
    assert (ours["bf16"], ours["fp16"], ours["params_dtype"]) == theirs
    optimizer = cfg.to_optimizer_config_kwargs()
    assert (optimizer["bf16"], optimizer["fp16"], optimizer["params_dtype"]) == theirs


def test_our_entry_refuses_fp16_which_it_cannot_loss_scale():
    from mcp_context.pretrain.launch import check_recipe_for_training

    cfg = load_recipe(None, ["model.params_dtype=float16"])
    with pytest.raises(RecipeError, match=r"model.params_dtype='float16' \(fp16 mixed precision, Megatron-LM's "
                                          r"--fp16\): mcp_context.pretrain has no loss scaling"):
        check_recipe_for_training(cfg, 4)


def test_dense_layers_among_moe_ones_print_without_spec_or_are_refused_naming_why():
    """Megatron-LM's --spec imports one object that cannot hold one layer spec per layer: a per-layer
    ``moe_layer_freq`` prints without --spec (Megatron-LM's own block spec, TE's attention runs CP), with a
    note; with the local layers and CP > 1, which Megatron-LM's local attention refuses, it is an error."""
    cfg = load_recipe(None, MOE + ["model.moe_layer_freq=[0, 1]", "model.layer_spec=te"])
    command = format_megatron_command(cfg)
    a = _parsed(command)
    assert a.spec is None and a.moe_layer_freq == [0, 1] and a.transformer_impl == "transformer_engine"
    assert "# model.moe_layer_freq=[0,1]: dense layers among MoE ones need one layer spec per layer" in command
    with pytest.raises(RecipeError, match=r"model.moe_layer_freq=\[0, 1\] with model.layer_spec='local' and "
                                          r"model.context_parallel_size=4: .* set model.layer_spec=te"):
        format_megatron_command(load_recipe(None, MOE + ["model.moe_layer_freq=[0, 1]"]))


def test_a_yarn_recipe_prints_the_yarn_flags_and_says_which_megatron_lm_has_them():
    """Non-MLA YaRN reaches Megatron-LM as --position-embedding-type yarn and the --yarn-* flags, which its
    parser has after core_v0.16.1 only (core_v0.16.1 refuses yarn there): the comment block says so."""
    cfg = load_recipe(None, YARN + ["model.yarn_rotary_scaling_factor=32.0",
                                    "model.yarn_correction_range_round_to_int=false"])
    validate_recipe(cfg)
    command = format_megatron_command(cfg)
    a = _parsed(command)
    assert (a.position_embedding_type, a.rotary_scaling_factor, a.yarn_correction_range_round_to_int) == \
        ("yarn", 32.0, False)
    assert "# model.position_embedding_type=yarn: the --yarn-* flags need Megatron-LM after core_v0.16.1" in command
