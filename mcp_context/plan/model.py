"""The model the planner plans for: the package's model shape with its sizes written out, and its memory.

The shape is ``mcp_context.recipes.schema.ModelConfig``, the one pretraining and the converter use;
``planning_shape`` fills the sizes megatron-core derives when they are left unset (from command-line
flags or a recipe) and checks them. Memory per rank is an estimate with stated assumptions (bf16
weights, fp32 main gradients, Adam states sharded by the distributed optimizer over DP x CP, full
activation recomputation with sequence parallelism); the attention layer's own working memory is
not estimated here but measured by the dry run.
"""
from __future__ import annotations

import dataclasses

from mcp_context.recipes.schema import ModelConfig

LLAMA3_VOCAB = 128256
PLANNED_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                  "ffn_hidden_size", "vocab_size", "gated_linear_unit")
"""The shape fields the planner reads (and reports)."""


def planning_shape(model: ModelConfig) -> ModelConfig:
    """``model`` with megatron-core's defaults written out (``num_query_groups``: one per head,
    ``kv_channels``: hidden / heads, ``ffn_hidden_size``: 4 * hidden) and Llama-3's vocabulary when
    it has none; ValueError naming the field for sizes below 1 or heads its groups do not divide."""
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        _check_positive(name, getattr(model, name))
    resolved = dataclasses.replace(
        model,
        num_query_groups=model.num_query_groups or model.num_attention_heads,
        kv_channels=model.kv_channels or model.hidden_size // model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        vocab_size=model.vocab_size or LLAMA3_VOCAB,
    )
    for name in ("num_query_groups", "kv_channels", "ffn_hidden_size", "vocab_size"):
        _check_positive(name, getattr(resolved, name))
    if resolved.num_attention_heads % resolved.num_query_groups:
        raise ValueError(f"num_attention_heads={resolved.num_attention_heads} is not a multiple of "
                         f"num_query_groups={resolved.num_query_groups}; use a divisor of it")
    return resolved


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}={value} must be a positive integer")


def parameters(model: ModelConfig) -> int:
    """Parameter count: attention, MLP and norms per layer, untied embedding and output layer."""
    h, d = model.hidden_size, model.kv_channels
    attention = h * model.num_attention_heads * d * 2 + h * model.num_query_groups * d * 2
    mlp = (3 if model.gated_linear_unit else 2) * h * model.ffn_hidden_size
    return model.num_layers * (attention + mlp + 2 * h) + 2 * model.vocab_size * h + h


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
