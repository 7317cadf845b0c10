"""Recipe checks: is a recipe a runnable job? One function, ``validate_recipe``, that the recipe
CLI, ``tools/prepare_data.py`` and the pretrain launcher all run before anything starts.

Owns the range of every numeric field (``RANGES``), the plain-name rule, the layout, batch,
schedule and data checks and the output-directory check. The context-parallel checks are
``mcp_context.megatron.config.validate_cp_config``, shared with the Megatron integration. No process
group, and no file access beyond a stat of the output directories.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from mcp_context.cp_rules import a2a_degree, comm_rule, dynamic_document_multiple, heads_per_tp_rank
from mcp_context.recipes.schema import (MLA_FIELDS, MOE_FIELDS, YARN_FIELDS, DataConfig, ModelConfig, RecipeConfig, RecipeError,
                                         check_vocab_size, precision)


def _resolve_world_size(cfg: RecipeConfig, world_size: Optional[int]) -> Optional[int]:
    """The launcher's world size (argument, else WORLD_SIZE), which must match train.world_size
    when the recipe plans one; else the planned one; else None."""
    env = os.environ.get("WORLD_SIZE")
    launched = world_size if world_size is not None else (int(env) if env else None)
    planned = cfg.train.world_size
    if launched is not None and planned is not None and launched != planned:
        raise RecipeError(
            f"train.world_size={planned} but the launch has {launched} ranks; set train.world_size={launched} "
            f"(and check the batch sizes) or launch {planned} ranks"
        )
    return launched if launched is not None else planned


def validate_recipe(cfg: RecipeConfig, world_size: Optional[int] = None) -> None:
    """Check that the recipe describes a runnable job; raise ``RecipeError`` naming the key.

    Runs every recipe check: a plain ``name``, each numeric field inside its ``RANGES`` entry, the
    layout, batch, schedule and data checks, and checkpoint/log directories that are not files.
    ``world_size`` (else the WORLD_SIZE variable, else ``train.world_size``) enables the
    data-parallel checks; a launch size that differs from ``train.world_size`` is an error. No
    process group, and no file access beyond a stat of the output directories: safe to call first.
    """
    m = cfg.model
    _validate_name(cfg.name)
    _validate_ranges(cfg)

    # The CP checks shared with the Megatron integration: one check, one message. Imported here
    # because mcp_context.megatron imports megatron-core (seconds), which loading a recipe does not need.
    from mcp_context.megatron.config import HCPConfigError, validate_cp_config

    try:  # our entry always trains with per-token loss (pretrain.build), which hybrid CP needs
        validate_cp_config(SimpleNamespace(**vars(m), calculate_per_token_loss=True), seq_length=m.seq_length,
                           prefix="model.")
    except HCPConfigError as err:
        raise RecipeError(str(err)) from err
    _validate_window_layers(m)
    _validate_attention_variant(m)
    _validate_mlp_variant(m)
    _validate_tensor_parallel_kv_heads(m)
    precision(m)  # bf16 and params_dtype must name one precision
    check_vocab_size(m)
    if m.num_layers % m.pipeline_model_parallel_size:
        raise RecipeError(
            f"model.num_layers={m.num_layers} is not divisible by "
            f"model.pipeline_model_parallel_size={m.pipeline_model_parallel_size}; choose a PP size "
            f"that divides the layer count"
        )
    if m.virtual_pipeline_model_parallel_size is not None:
        stages = m.pipeline_model_parallel_size * m.virtual_pipeline_model_parallel_size
        if m.pipeline_model_parallel_size < 2 or m.num_layers % stages:
            raise RecipeError(
                f"model.virtual_pipeline_model_parallel_size={m.virtual_pipeline_model_parallel_size} "
                f"needs model.pipeline_model_parallel_size > 1 and num_layers={m.num_layers} divisible by "
                f"pipeline * virtual stages = {stages}; set it to null or change the layout"
            )
    if m.position_embedding_type == "learned_absolute" and (m.max_position_embeddings or m.seq_length) < m.seq_length:
        raise RecipeError(
            f"model.max_position_embeddings={m.max_position_embeddings} is smaller than "
            f"model.seq_length={m.seq_length}; raise it to at least {m.seq_length}"
        )
    _validate_step_graphs(cfg)
    world = _resolve_world_size(cfg, world_size)
    _validate_dynamic_cp(cfg, world)
    _validate_batch(cfg, world)
    _validate_schedule(cfg)
    _validate_data(cfg.data)
    _validate_paths(cfg)


def _validate_window_layers(m: ModelConfig) -> None:
    """``window_attn_skip_freq`` as megatron-core's ``is_layer_window_attention`` reads it: an int
    divides the layer number (0 would divide by zero), a list is indexed by it (one entry a layer)."""
    freq, key = m.window_attn_skip_freq, "model.window_attn_skip_freq"
    if freq is None:
        return
    if m.window_size is None:
        raise RecipeError(f"{key}={freq!r} picks the sliding-window layers, but model.window_size is null; set "
                          f"model.window_size (e.g. [4095, 0]) or set {key} to null")
    _check_layer_pattern(key, freq, m.num_layers, "attends in full", "full attention", "window",
                         "; use null for a window on every layer")


def _unused_fields(m: ModelConfig, names: tuple, switch: str) -> None:
    """Fields of a feature that is off must keep their defaults: a set one would be ignored silently."""
    defaults = ModelConfig()
    for name in names:
        if getattr(m, name) != getattr(defaults, name):
            raise RecipeError(f"model.{name}={getattr(m, name)!r} has no effect without {switch}; set {switch} or "
                              f"remove model.{name}")


_MLA_YARN_FIELDS = ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim")


def _validate_attention_variant(m: ModelConfig) -> None:
    """MLA as megatron-core's ``MLATransformerConfig`` and Megatron-LM build it: no grouped-query
    attention, no kv_channels, RoPE inside the attention (so no Llama-3.1 scaling), YaRN fields only
    with rope_type yarn. Without MLA, the ``yarn_*`` fields only with position_embedding_type yarn, which
    replaces Llama-3.1 scaling."""
    if m.position_embedding_type != "yarn":
        _unused_fields(m, YARN_FIELDS, "model.position_embedding_type=yarn")
    elif m.rope_scaling:
        raise RecipeError("model.rope_scaling=true with model.position_embedding_type='yarn': YaRN is the RoPE "
                          "scaling; set model.rope_scaling=false")
    if not m.multi_latent_attention:
        _unused_fields(m, MLA_FIELDS, "model.multi_latent_attention=true")
        return
    why = "multi-latent attention"
    if m.num_query_groups not in (None, m.num_attention_heads):
        raise RecipeError(f"model.num_query_groups={m.num_query_groups}: {why} has one key/value head per query "
                          f"head (no grouped-query attention; Megatron-LM refuses --group-query-attention with it); "
                          f"set model.num_query_groups=null")
    if m.kv_channels is not None:
        raise RecipeError(f"model.kv_channels={m.kv_channels}: {why} takes its head dims from model.qk_head_dim + "
                          f"model.qk_pos_emb_head_dim (query/key) and model.v_head_dim (value); set "
                          f"model.kv_channels=null")
    if m.position_embedding_type != "rope" or m.rope_scaling:
        raise RecipeError(f"model.position_embedding_type={m.position_embedding_type!r} with model.rope_scaling="
                          f"{str(m.rope_scaling).lower()}: {why} applies RoPE itself (model.rope_type); set "
                          f"model.position_embedding_type=rope and model.rope_scaling=false")
    if m.qk_pos_emb_head_dim % 2:
        raise RecipeError(f"model.qk_pos_emb_head_dim={m.qk_pos_emb_head_dim} must be even: RoPE rotates pairs of "
                          f"dimensions")
    if m.rope_type == "rope":
        _unused_fields(m, _MLA_YARN_FIELDS, "model.rope_type=yarn")


def _validate_mlp_variant(m: ModelConfig) -> None:
    """The GLU's offset and clamp, and MoE routing as megatron-core's ``TransformerConfig`` checks it
    (named by recipe key here, before megatron-core's assertion would)."""
    for name, value, unset in (("glu_linear_offset", m.glu_linear_offset, 0.0),
                               ("activation_func_clamp_value", m.activation_func_clamp_value, None)):
        if value != unset and not m.gated_linear_unit:
            raise RecipeError(f"model.{name}={value} applies to a gated MLP only; set model.gated_linear_unit=true "
                              f"or remove model.{name}")
    if m.num_moe_experts is None:
        _unused_fields(m, MOE_FIELDS, "model.num_moe_experts")
        return
    experts = m.num_moe_experts
    if m.moe_router_topk > experts:
        raise RecipeError(f"model.moe_router_topk={m.moe_router_topk} is more than model.num_moe_experts={experts}; "
                          f"route each token to at most {experts} experts")
    freq, key = m.moe_layer_freq, "model.moe_layer_freq"
    _check_layer_pattern(key, freq, m.num_layers, "is MoE", "dense", "MoE")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise RecipeError(f"model.moe_router_enable_expert_bias=true needs model.moe_router_score_function=sigmoid "
                          f"(megatron-core's aux-loss-free routing), not {m.moe_router_score_function!r}")
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise RecipeError(f"model.moe_router_num_groups={groups} with model.moe_router_group_topk={group_topk}: "
                          f"group-limited routing needs both (e.g. 8 and 4), or neither")
    if groups is not None:
        if experts % groups or group_topk > groups:
            raise RecipeError(f"model.moe_router_num_groups={groups}, model.moe_router_group_topk={group_topk}: the "
                              f"groups must divide model.num_moe_experts={experts} and at most all of them be chosen")
        if m.moe_router_topk > group_topk * (experts // groups):
            raise RecipeError(f"model.moe_router_topk={m.moe_router_topk} is more than the "
                              f"{group_topk * (experts // groups)} experts of model.moe_router_group_topk={group_topk} "
                              f"groups of {experts // groups}; choose more groups or a smaller top-k")


def _check_layer_pattern(key: str, freq, num_layers: int, nth: str, zero: str, one: str, hint: str = "") -> None:
    """megatron-core's per-layer pattern fields (``window_attn_skip_freq``, ``moe_layer_freq``): an int
    n >= 1 (every n-th layer ``nth``) or one 0 (``zero``) / 1 (``one``) per layer."""
    if isinstance(freq, int) and freq < 1:
        raise RecipeError(f"{key}={freq} must be an integer n >= 1 (every n-th layer {nth}) or a list of 0/1, one "
                          f"per layer{hint}")
    if isinstance(freq, list) and (len(freq) != num_layers or any(v not in (0, 1) for v in freq)):
        raise RecipeError(f"{key}={freq!r} must hold one 0 ({zero}) or 1 ({one}) per layer: model.num_layers="
                          f"{num_layers} entries")


def _validate_tensor_parallel_kv_heads(m: ModelConfig) -> None:
    """The TP heads rule (``cp_rules.heads_per_tp_rank``, megatron-core's), named in the recipe's keys."""
    try:
        heads_per_tp_rank(m.num_attention_heads, m.num_query_groups or m.num_attention_heads,
                          m.tensor_model_parallel_size, prefix="model.")
    except ValueError as err:
        raise RecipeError(str(err)) from None


def _validate_step_graphs(cfg: RecipeConfig) -> None:
    """``model.cp_step_graphs`` where the engine can replay the step (``algorithms/graphs.refusal``): on CUDA,
    with K/V local to the step, no attention dropout and no packed documents; refused here, before a launch."""
    m = cfg.model
    if not m.cp_step_graphs:
        return
    ring = m.context_parallel_size // a2a_degree(m.cp_comm_type, m.hierarchical_context_parallel_sizes
                                                 or [m.context_parallel_size]) > 1
    refused = [(setting, why) for setting, why, bad in [
        (f"train.device={cfg.train.device!r}", "CUDA graphs replay on a CUDA device; set train.device=cuda",
         cfg.train.device == "cpu"),
        (f"model.cp_comm_type={m.cp_comm_type!r}", "its ring moves K/V between ranks inside the step, whose "
         "transfers are not captured; use a2a, all_gather or a2a+all_gather",
         comm_rule(m.cp_comm_type).kv == "ring" and ring),
        (f"model.attention_dropout={m.attention_dropout}", "dropout draws a new mask per call; set it to 0",
         m.attention_dropout > 0),
        ("data.reset_attention_mask=true", "packed documents change from batch to batch, and each packing would "
         "capture new graphs; set it false", cfg.data.reset_attention_mask),
        ("model.hybrid_context_parallel=true", "dynamic CP runs packed documents; set it false",
         m.hybrid_context_parallel)] if bad]
    if refused:
        setting, why = refused[0]
        raise RecipeError(f"model.cp_step_graphs=true with {setting}: {why}; or set model.cp_step_graphs=false")


def _validate_dynamic_cp(cfg: RecipeConfig, world_size: Optional[int]) -> None:
    """``model.hybrid_context_parallel`` as ``pretrain.dynamic`` runs it: the documents of a step (split at the
    end-of-document tokens) spread over groups of the data parallel ranks, each document padded to a multiple
    of 2 x the data parallel size (zigzag's two chunks a rank on the largest group), fp32, TP = PP = 1."""
    m = cfg.model
    budget = m.max_seqlen_per_dp_cp_rank
    if not m.hybrid_context_parallel:
        if budget is not None:
            raise RecipeError(f"model.max_seqlen_per_dp_cp_rank={budget} is the budget of dynamic CP, which is off; "
                              f"set model.hybrid_context_parallel=true, or model.max_seqlen_per_dp_cp_rank=null")
        return
    untested = [(f"model.{key}={value!r}", fix) for key, value, bad, fix in [
        ("tensor_model_parallel_size", m.tensor_model_parallel_size, m.tensor_model_parallel_size != 1, "set it to 1"),
        ("pipeline_model_parallel_size", m.pipeline_model_parallel_size, m.pipeline_model_parallel_size != 1,
         "set it to 1"),
        ("multi_latent_attention", m.multi_latent_attention, m.multi_latent_attention,
         "megatron-core's MLA layer asserts local_cp_size is None; use a fixed context_parallel_size"),
        ("num_moe_experts", m.num_moe_experts, m.num_moe_experts is not None, "set it to null"),
        ("params_dtype", m.params_dtype, precision(m) != "fp32", "train in float32")] if bad]
    if untested:
        setting, fix = untested[0]
        raise RecipeError(f"{setting} with model.hybrid_context_parallel=true: the dynamic CP step runner "
                          f"(mcp_context.pretrain.dynamic) is built and tested for dense fp32 models at TP = PP = 1 "
                          f"only; {fix}, or set model.hybrid_context_parallel=false")
    if not cfg.data.reset_attention_mask:
        raise RecipeError("model.hybrid_context_parallel=true spreads a step's documents (split at the end-of-document "
                          "tokens) over groups of ranks, each attending only to itself; set "
                          "data.reset_attention_mask=true (data.reset_attention_mask=false has no documents to spread)")
    if world_size is None:
        return
    sizes = m.hierarchical_context_parallel_sizes
    if sizes is not None and math.prod(sizes) != world_size:
        raise RecipeError(f"model.hierarchical_context_parallel_sizes={sizes} multiplies to {math.prod(sizes)}, but with "
                          f"model.hybrid_context_parallel=true it describes the data parallel group of all "
                          f"{world_size} ranks; make the product {world_size} (level 0: one all-to-all domain)")
    multiple = dynamic_document_multiple(world_size)
    if budget % multiple:
        raise RecipeError(f"model.max_seqlen_per_dp_cp_rank={budget} is not a multiple of 2 x {world_size} ranks = "
                          f"{multiple}: every document is padded to that multiple (zigzag's two chunks a rank on the "
                          f"largest group), so only multiples of it bound a group exactly; use "
                          f"{' or '.join(str(b) for b in (budget - budget % multiple, budget + multiple - budget % multiple) if b)}")
    longest = m.seq_length + (-m.seq_length % multiple)
    if budget * world_size < longest:
        raise RecipeError(f"model.max_seqlen_per_dp_cp_rank={budget}: a document as long as a sample "
                          f"(model.seq_length={m.seq_length}, padded to {longest}) does not fit all {world_size} ranks "
                          f"({budget * world_size} tokens at most); raise it to at least "
                          f"{-(-longest // world_size // multiple) * multiple}")


def _validate_batch(cfg: RecipeConfig, world_size: Optional[int]) -> None:
    m, t = cfg.model, cfg.train
    if t.global_batch_size % t.micro_batch_size:
        raise RecipeError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size}"
        )
    if world_size is None:
        return
    model_ranks = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    if world_size % model_ranks:
        raise RecipeError(
            f"world size {world_size} (train.world_size or WORLD_SIZE) is not divisible by "
            f"tensor * pipeline * context parallel sizes = {model_ranks}; launch a multiple of {model_ranks} ranks"
        )
    dp = world_size // model_ranks
    if m.hybrid_context_parallel:  # every rank reads the whole global batch and plans its documents
        return
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise RecipeError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size * data-parallel size = {t.micro_batch_size} * {dp}; "
            f"use a multiple of {t.micro_batch_size * dp}"
        )


def _validate_schedule(cfg: RecipeConfig) -> None:
    t, o = cfg.train, cfg.optimizer
    decay = t.lr_decay_iters if t.lr_decay_iters is not None else t.steps
    if not 0 <= t.lr_warmup_iters < decay:
        raise RecipeError(
            f"train.lr_warmup_iters={t.lr_warmup_iters} must be at least 0 and less than the decay length "
            f"(train.lr_decay_iters or train.steps = {decay}: megatron-core's scheduler asserts warm-up < decay); "
            f"lower train.lr_warmup_iters or raise train.steps / train.lr_decay_iters"
        )
    if t.lr_decay_style == "WSD":
        raise RecipeError(
            "train.lr_decay_style='WSD' needs a WSD decay length, which recipes have no field for; "
            "use 'cosine', 'linear', 'inverse-square-root' or 'constant'"
        )
    if not 0 <= o.min_lr <= o.lr:
        raise RecipeError(f"optimizer.min_lr={o.min_lr} must be between 0 and optimizer.lr={o.lr}")


def _validate_data(d: DataConfig) -> None:
    split_weights(d.split)
    if d.tokenizer_type == "HuggingFaceTokenizer" and d.tokenizer_model is None:
        raise RecipeError(
            "data.tokenizer_type='HuggingFaceTokenizer' needs data.tokenizer_model (a tokenizer directory)"
        )
    if d.reset_attention_mask and d.create_attention_mask:
        raise RecipeError(
            "data.reset_attention_mask=true trains every sample as packed documents whose mask comes from the "
            "end-of-document tokens (cu_seqlens, thd); data.create_attention_mask=true would build an [s, s] mask "
            "per sample that the packed attention cannot take: set data.create_attention_mask=false"
        )


def split_weights(split: str) -> list[float]:
    """The train, valid, test weights of a ``data.split`` string (Megatron's ``--split``), padded
    with zeros to three; raise ``RecipeError`` unless they are up to three finite non-negative
    numbers with a positive sum."""
    try:
        weights = [float(p) for p in split.split(",")]
    except ValueError:
        weights = []
    if (not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights)
            or sum(weights) <= 0):
        raise RecipeError(
            f"data.split={split!r} must be up to three non-negative train,valid,test weights (finite numbers "
            f"with a positive sum), e.g. '949,50,1'"
        )
    return weights + [0.0] * (3 - len(weights))


_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _validate_name(name: str) -> None:
    """``runs/<name>`` is derived from the name, so it must stay one plain directory name."""
    if not _PLAIN_NAME.fullmatch(name) or ".." in name:
        plain = re.sub(r"[^A-Za-z0-9._-]+", "_", name).replace("..", "_").strip("._-") or "my_recipe"
        raise RecipeError(
            f"name={name!r} must be a plain name (letters, digits, '.', '_', '-'; no path separator, no '..'), "
            f"since the run directory runs/<name> is derived from it; e.g. name: {plain}"
        )


@dataclass(frozen=True)
class Range:
    """The values a numeric recipe field may take: ``lo``/``hi`` bounds (None: unbounded), each
    closed unless marked open. Floats must also be finite; ``why`` explains a bound that is not obvious."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def describe(self, key: str, integer: bool) -> str:
        """What the field must be, e.g. ``a finite number with 0 <= optimizer.adam_beta1 < 1``."""
        if self.lo is None and self.hi is None:
            what = "a finite number"
        elif integer and self.hi is None and self.lo in (0, 1) and not self.lo_open:
            what = "a positive integer" if self.lo == 1 else "a non-negative integer"
        else:
            lo = "" if self.lo is None else f"{_number(self.lo)} {'<' if self.lo_open else '<='} "
            hi = "" if self.hi is None else f" {'<' if self.hi_open else '<='} {_number(self.hi)}"
            if self.hi is None:
                lo, hi = "", f" {'>' if self.lo_open else '>='} {_number(self.lo)}"
            what = f"{'an integer' if integer else 'a finite number'} with {lo}{key}{hi}"
        return what + (f" ({self.why})" if self.why else "")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


_POSITIVE = Range(1)
_NON_NEGATIVE = Range(0)
_PROBABILITY = Range(0, 1, hi_open=True, why="a dropout probability")
_BETA = Range(0, 1, hi_open=True, why="an exponential-average decay")
_POSITIVE_REAL = Range(0, lo_open=True)
_SEED = Range(0, 2**32 - 1, why="numpy seeds are 32-bit")

RANGES: dict[str, Range] = {
    "model.num_layers": _POSITIVE,
    "model.hidden_size": _POSITIVE,
    "model.ffn_hidden_size": _POSITIVE,
    "model.num_attention_heads": _POSITIVE,
    "model.num_query_groups": _POSITIVE,
    "model.kv_channels": _POSITIVE,
    "model.seq_length": _POSITIVE,
    "model.max_position_embeddings": _POSITIVE,
    "model.vocab_size": _POSITIVE,
    "model.make_vocab_size_divisible_by": _POSITIVE,
    "model.rotary_base": _POSITIVE,
    "model.rotary_percent": Range(0, 1, lo_open=True, why="the fraction of each head that RoPE rotates"),
    "model.rope_scaling_factor": _POSITIVE_REAL,
    "model.window_size": Range(-1, why="-1: unbounded on that side"),
    "model.window_attn_skip_freq": Range(0, why="an int n >= 1: each n-th layer attends in full; a list: 0 or 1 "
                                                "per layer"),
    "model.layernorm_epsilon": Range(0, 1, lo_open=True, hi_open=True),
    "model.glu_linear_offset": Range(why="any finite offset"),
    "model.activation_func_clamp_value": _POSITIVE_REAL,
    "model.yarn_rotary_scaling_factor": _POSITIVE_REAL,
    "model.yarn_original_max_position_embeddings": _POSITIVE,
    "model.yarn_beta_fast": _POSITIVE_REAL,
    "model.yarn_beta_slow": _POSITIVE_REAL,
    "model.yarn_mscale": _POSITIVE_REAL,
    "model.yarn_mscale_all_dim": Range(0),
    "model.q_lora_rank": _POSITIVE,
    "model.kv_lora_rank": _POSITIVE,
    "model.qk_head_dim": _POSITIVE,
    "model.qk_pos_emb_head_dim": _POSITIVE,
    "model.v_head_dim": _POSITIVE,
    "model.rotary_scaling_factor": _POSITIVE_REAL,
    "model.original_max_position_embeddings": _POSITIVE,
    "model.beta_fast": _POSITIVE_REAL,
    "model.beta_slow": _POSITIVE_REAL,
    "model.mscale": _POSITIVE_REAL,
    "model.mscale_all_dim": Range(0),
    "model.num_moe_experts": _POSITIVE,
    "model.moe_ffn_hidden_size": _POSITIVE,
    "model.moe_router_topk": _POSITIVE,
    "model.moe_layer_freq": Range(0, why="an int n >= 1: every n-th layer is MoE; a list: 0 or 1 per layer"),
    "model.moe_shared_expert_intermediate_size": _POSITIVE,
    "model.moe_router_topk_scaling_factor": _POSITIVE_REAL,
    "model.moe_router_num_groups": _POSITIVE,
    "model.moe_router_group_topk": _POSITIVE,
    "model.moe_aux_loss_coeff": Range(0),
    "model.attention_dropout": _PROBABILITY,
    "model.hidden_dropout": _PROBABILITY,
    "model.init_method_std": _POSITIVE_REAL,
    "model.tensor_model_parallel_size": _POSITIVE,
    "model.pipeline_model_parallel_size": _POSITIVE,
    "model.virtual_pipeline_model_parallel_size": _POSITIVE,
    "model.context_parallel_size": _POSITIVE,
    "model.hierarchical_context_parallel_sizes": _POSITIVE,
    "model.recompute_num_layers": _POSITIVE,
    "model.max_seqlen_per_dp_cp_rank": _POSITIVE,
    "data.tokenizer_vocab_size": Range(
        262, why="SentencePiece needs the 4 special ids, the newline piece and 256 byte-fallback pieces, plus one"),
    "data.seed": _SEED,
    "data.num_workers": _NON_NEGATIVE,
    "train.steps": Range(1, 10**8, why="10**8 steps is far beyond any run, and a larger count makes the "
                                       "sample index build effectively forever"),
    "train.global_batch_size": _POSITIVE,
    "train.micro_batch_size": _POSITIVE,
    "train.world_size": _POSITIVE,
    "train.lr_warmup_iters": _NON_NEGATIVE,
    "train.lr_decay_iters": _POSITIVE,
    "train.eval_interval": _POSITIVE,
    "train.eval_iters": Range(0, why="0 disables evaluation"),
    "train.seed": _SEED,
    "optimizer.lr": _POSITIVE_REAL,
    "optimizer.min_lr": Range(0),
    "optimizer.weight_decay": Range(0),
    "optimizer.adam_beta1": _BETA,
    "optimizer.adam_beta2": _BETA,
    "optimizer.adam_eps": Range(0, 1, lo_open=True, hi_open=True),
    "optimizer.clip_grad": Range(0, why="0 disables clipping"),
    "checkpoint.save_interval": _POSITIVE,
    "logging.log_interval": _POSITIVE,
}
"""Allowed range of every numeric recipe field (a list field: of each item), by dotted key."""


def _validate_ranges(cfg: RecipeConfig) -> None:
    for dotted, allowed in RANGES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        items = [(dotted, value)] if not isinstance(value, list) else [
            (f"{dotted}[{i}]", v) for i, v in enumerate(value)]
        for name, v in items:
            if v is not None and v not in allowed:
                raise RecipeError(f"{name}={v!r} must be {allowed.describe(name, isinstance(v, int))}")


def _validate_paths(cfg: RecipeConfig) -> None:
    """Directories the run writes or reads must not be files (the only file-system access here:
    a stat of each path and its parents)."""
    for key in ("checkpoint.save", "checkpoint.load", "checkpoint.pretrained", "logging.tensorboard_dir"):
        section, field_name = key.split(".")
        value = getattr(getattr(cfg, section), field_name)
        if value is None:
            continue
        path = Path(value).expanduser()
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            where = "is" if existing == path else f"is inside {existing}, which is"
            raise RecipeError(
                f"{key}={value!r} {where} an existing file, not a directory; give a directory path "
                f"(created when missing), or null"
            )
