"""The model the planner plans for: the package's model shape with its sizes written out, its memory, and
the FLOPs a token costs in its linear layers.

The shape is ``mcp_context.recipes.schema.ModelConfig``, the one pretraining and the converter use;
``planning_shape`` fills the sizes megatron-core derives when they are left unset (from command-line
flags or a recipe) and checks them. Memory per rank is an estimate with stated assumptions (bf16
weights, fp32 main gradients, Adam states sharded by the distributed optimizer over DP x CP, full
activation recomputation with sequence parallelism); the attention layer's own working memory is
not estimated here but measured by the dry run.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from mcp_context.recipes.schema import ModelConfig

LLAMA3_VOCAB = 128256
PLANNED_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                  "ffn_hidden_size", "vocab_size", "gated_linear_unit", "multi_latent_attention", "v_head_dim",
                  "num_moe_experts")
"""The shape fields the planner reads (and reports)."""


def head_dims(model: ModelConfig) -> tuple[int, int]:
    """The attention's (query/key, value) head dims: MLA's ``qk_head_dim + qk_pos_emb_head_dim`` and
    ``v_head_dim`` (DeepSeek-V3: 192 and 128), else ``kv_channels`` for both (None: hidden / heads)."""
    if model.multi_latent_attention:
        return model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim
    d = model.kv_channels or model.hidden_size // model.num_attention_heads
    return d, d


def planning_shape(model: ModelConfig) -> ModelConfig:
    """``model`` with megatron-core's defaults written out (``num_query_groups``: one per head,
    ``kv_channels``: hidden / heads, ``ffn_hidden_size``: 4 * hidden) and Llama-3's vocabulary when
    it has none; ValueError naming the field for sizes below 1 or heads its groups do not divide.
    With MLA ``kv_channels`` is the query/key head dim and every head has its own K and V (no groups);
    ``v_head_dim`` is then the value head dim, else set to ``kv_channels``."""
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        _check_positive(name, getattr(model, name))
    dqk, dv = head_dims(model)
    resolved = dataclasses.replace(
        model,
        num_query_groups=model.num_attention_heads if model.multi_latent_attention
        else model.num_query_groups or model.num_attention_heads,
        kv_channels=dqk,
        v_head_dim=dv,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        vocab_size=model.vocab_size or LLAMA3_VOCAB,
    )
    for name in ("num_query_groups", "kv_channels", "v_head_dim", "ffn_hidden_size", "vocab_size"):
        _check_positive(name, getattr(resolved, name))
    if resolved.num_attention_heads % resolved.num_query_groups:
        raise ValueError(f"num_attention_heads={resolved.num_attention_heads} is not a multiple of "
                         f"num_query_groups={resolved.num_query_groups}; use a divisor of it")
    return resolved


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}={value} must be a positive integer")


def parameters(model: ModelConfig) -> int:
    """Parameter count of a ``planning_shape``: attention (MLA's down/up projections), MLP (MoE: every
    expert, the shared experts and the router, in ``moe_layer_freq``'s layers) and norms per layer,
    untied embedding and output layer."""
    h, heads, d, dv = model.hidden_size, model.num_attention_heads, model.kv_channels, model.v_head_dim
    if model.multi_latent_attention:
        q = h * heads * d if model.q_lora_rank is None else h * model.q_lora_rank + model.q_lora_rank * heads * d
        kv = h * (model.kv_lora_rank + model.qk_pos_emb_head_dim) + model.kv_lora_rank * heads * (
            model.qk_head_dim + dv)
        attention = q + kv + heads * dv * h
    else:
        attention = h * heads * d * 2 + h * model.num_query_groups * d * 2
    glu = 3 if model.gated_linear_unit else 2
    dense = glu * h * model.ffn_hidden_size
    layers = model.num_layers * (attention + 2 * h)
    moe_layers = _moe_layers(model)
    if moe_layers:
        moe = (model.num_moe_experts * glu * h * (model.moe_ffn_hidden_size or model.ffn_hidden_size)
               + glu * h * (model.moe_shared_expert_intermediate_size or 0) + h * model.num_moe_experts)
        layers += moe_layers * moe
    layers += (model.num_layers - moe_layers) * dense
    return layers + 2 * model.vocab_size * h + h


LINEAR_FWD_BWD_FLOP_FACTOR = 3  # forward + backward FLOPs of a matmul over its forward's (dX and dW)


def linear_flops_per_token(model: ModelConfig) -> Optional[int]:
    """Forward+backward FLOPs one token of a ``planning_shape`` costs outside the attention core: 2 per
    parameter it passes through (every one of ``parameters`` but the input embedding, a lookup; the norms'
    few counted as if matmuls), times ``LINEAR_FWD_BWD_FLOP_FACTOR``. None for an MoE model: its tokens pass
    through the experts their routing picks, which is not modelled."""
    if model.num_moe_experts is not None:
        return None
    return 2 * LINEAR_FWD_BWD_FLOP_FACTOR * (parameters(model) - model.vocab_size * model.hidden_size)


def _moe_layers(model: ModelConfig) -> int:
    """How many layers are MoE (megatron-core's ``moe_layer_freq``: every n-th, or a 0/1 list)."""
    if model.num_moe_experts is None:
        return 0
    freq = model.moe_layer_freq
    return sum(freq) if isinstance(freq, list) else len(range(0, model.num_layers, freq))


def model_state_bytes(model: ModelConfig, tp: int, pp: int, dp_cp: int) -> int:
    """Weights (bf16), main gradients (fp32) and Adam master/m/v (fp32, sharded over ``dp_cp``)."""
    per_rank = parameters(model) / (tp * pp)
    return int(per_rank * (2 + 4) + per_rank * 12 / dp_cp)


def checkpointed_activation_bytes(model: ModelConfig, s_local: int, batch: int, tp: int, pp: int) -> int:
    """Layer inputs kept under full recomputation on the first pipeline stage (1F1B keeps ``pp``
    micro-batches in flight), bf16, sharded over TP by sequence parallelism."""
    layers_per_stage = model.num_layers // pp
    return 2 * s_local * batch * model.hidden_size // tp * layers_per_stage * pp


def layer_working_bytes(model: ModelConfig, s_local: int, batch: int, tp: int) -> int:
    """One layer's activations while it is recomputed, outside the attention core: 34*s*b*h/t bytes
    (Korthikanti et al. 2022, bf16, with sequence parallelism)."""
    return 34 * s_local * batch * model.hidden_size // tp
