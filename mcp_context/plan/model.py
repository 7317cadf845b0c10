"""The model the planner plans for: its shape, from command-line flags or a recipe, and its memory.

``ModelShape`` holds the ``TransformerConfig`` numbers the planner needs; ``from_recipe`` reads them
from a recipe's ``model`` section. Memory per rank is an estimate with stated assumptions (bf16
weights, fp32 main gradients, Adam states sharded by the distributed optimizer over DP x CP, full
activation recomputation with sequence parallelism); the attention layer's own working memory is
not estimated here but measured by the dry run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LLAMA3_VOCAB = 128256


@dataclass(frozen=True)
class ModelShape:
    """A GPT's dimensions in megatron-core's names."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int = LLAMA3_VOCAB
    gated_linear_unit: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                     "ffn_hidden_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_query_groups={self.num_query_groups}; use a divisor of it")

    @classmethod
    def build(cls, num_layers: int, hidden_size: int, num_attention_heads: int,
              num_query_groups: Optional[int] = None, kv_channels: Optional[int] = None,
              ffn_hidden_size: Optional[int] = None, vocab_size: Optional[int] = None,
              gated_linear_unit: bool = True) -> "ModelShape":
        """Fill megatron-core's defaults for the optional sizes."""
        return cls(num_layers, hidden_size, num_attention_heads, num_query_groups or num_attention_heads,
                   kv_channels or hidden_size // num_attention_heads, ffn_hidden_size or 4 * hidden_size,
                   vocab_size or LLAMA3_VOCAB, gated_linear_unit)

    @classmethod
    def from_recipe(cls, model_cfg) -> "ModelShape":
        """From a recipe's ``model`` section (``mcp_context.recipes.ModelConfig``)."""
        m = model_cfg
        return cls.build(m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels,
                         m.ffn_hidden_size, m.vocab_size, m.gated_linear_unit)

    def parameters(self) -> int:
        """Parameter count: attention, MLP and norms per layer, untied embedding and output layer."""
        h, d = self.hidden_size, self.kv_channels
        attention = h * self.num_attention_heads * d * 2 + h * self.num_query_groups * d * 2
        mlp = (3 if self.gated_linear_unit else 2) * h * self.ffn_hidden_size
        return self.num_layers * (attention + mlp + 2 * h) + 2 * self.vocab_size * h + h

    def model_state_bytes(self, tp: int, pp: int, dp_cp: int) -> int:
        """Weights (bf16), main gradients (fp32) and Adam master/m/v (fp32, sharded over ``dp_cp``)."""
        per_rank = self.parameters() / (tp * pp)
        return int(per_rank * (2 + 4) + per_rank * 12 / dp_cp)

    def checkpointed_activation_bytes(self, s_local: int, batch: int, tp: int, pp: int) -> int:
        """Layer inputs kept under full recomputation on the first pipeline stage (1F1B keeps ``pp``
        micro-batches in flight), bf16, sharded over TP by sequence parallelism."""
        layers_per_stage = self.num_layers // pp
        return 2 * s_local * batch * self.hidden_size // tp * layers_per_stage * pp

    def layer_working_bytes(self, s_local: int, batch: int, tp: int) -> int:
        """One layer's activations while it is recomputed, outside the attention core: 34*s*b*h/t bytes
        (Korthikanti et al. 2022, bf16, with sequence parallelism)."""
        return 34 * s_local * batch * self.hidden_size // tp
