"""Hugging Face Llama-family ``config.json`` <-> Megatron-Core ``TransformerConfig`` / ``GPTModel``.

Owns :class:`LlamaArchitecture` (the few numbers both sides agree on), its validation against what
megatron-core can represent, and the builder of the matching ``GPTModel``. Unsupported features
(other model types, biases Megatron cannot place, RoPE variants megatron-core 0.16 lacks) are
refused with an error naming the config field, its value and what to do; nothing is dropped quietly.
It does not touch weights (``mapping``) or files (``hf_io``, ``mcore_io``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM"}
# megatron-core's RotaryEmbedding._apply_scaling hard-codes these Llama-3 constants; only `factor`
# is configurable (GPTModel(rope_scaling=True, rope_scaling_factor=...)).
MCORE_LLAMA3_ROPE_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}


class UnsupportedArchitectureError(ValueError):
    """The Hugging Face config describes a model this converter cannot represent in Megatron-Core."""


@dataclass(frozen=True)
class LlamaArchitecture:
    """Shape and numerics of a dense Llama-family decoder (Llama 2/3, Mistral, Qwen2)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling_factor: Optional[float] = None  # Llama-3 style scaling; None = plain RoPE
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LlamaArchitecture":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        missing = sorted(n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING)
        if unknown or missing:
            raise ValueError(f"architecture record has unknown fields {unknown} and lacks fields {missing}; it "
                             f"was written by a different version of mcp_context.convert")
        return cls(**data)


def _refuse(field: str, value: Any, why: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"config.json field {field}={value!r}: {why}")


def _positive_int(cfg: dict[str, Any], field: str, default: Optional[int] = None) -> int:
    """``cfg[field]`` as an integer >= 1; absent or null means ``default`` (required when None)."""
    value = cfg.get(field)
    if value is None and default is not None:
        return default
    if value is None and field not in cfg:
        raise ValueError(f"config.json has no field {field}; a Llama-family config needs it (an integer >= 1)")
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or value < 1:
        raise ValueError(f"config.json field {field}={value!r}: must be an integer >= 1; fix config.json")
    return int(value)


def _positive_float(value: Any, field: str) -> float:
    """``value`` (of config field ``field``) as a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"config.json field {field}={value!r}: must be a finite number > 0; fix config.json")
    return float(value)


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, Optional[float]]:
    """(rope_theta, llama3 factor or None) from either the transformers-5 ``rope_parameters`` dict
    or the older top-level ``rope_theta`` / ``rope_scaling`` fields."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = _positive_float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise _refuse("rope_scaling.rope_type", rope_type,
                      "megatron-core 0.16 GPTModel represents only plain RoPE and Llama-3 scaling "
                      "('default' or 'llama3'); convert a model without this RoPE variant")
    for name, expected in MCORE_LLAMA3_ROPE_CONSTANTS.items():
        if params.get(name, expected) != expected:
            raise _refuse(f"rope_scaling.{name}", params[name],
                          f"megatron-core 0.16 hard-codes {name}={expected} for Llama-3 RoPE scaling "
                          f"(only 'factor' is configurable), so this model cannot be represented")
    return theta, _positive_float(params.get("factor"), "rope_scaling.factor")


def architecture_from_hf_config(cfg: dict[str, Any]) -> LlamaArchitecture:
    """Validate a Hugging Face ``config.json`` dict and return its :class:`LlamaArchitecture`."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _refuse("model_type", model_type,
                      f"supported model types are {sorted(SUPPORTED_MODEL_TYPES)} (dense Llama-family "
                      f"decoders); other architectures need their own converter")
    archs = cfg.get("architectures") or [SUPPORTED_MODEL_TYPES[model_type]]
    if archs != [SUPPORTED_MODEL_TYPES[model_type]]:
        raise _refuse("architectures", archs,
                      f"only {SUPPORTED_MODEL_TYPES[model_type]} (the causal-LM head) is supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", cfg["hidden_act"], "Llama-family SwiGLU needs 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag, False):
            raise _refuse(flag, cfg[flag], "biases on all projections are not a Llama-family layout; "
                          "megatron-core places them only through add_bias_linear, which also adds "
                          "biases HF does not have")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse("partial_rotary_factor", cfg["partial_rotary_factor"], "only full RoPE is supported")
    if model_type == "qwen2" and cfg.get("use_sliding_window", False):
        raise _refuse("use_sliding_window", True,
                      "Qwen2 per-layer sliding windows (max_window_layers) have no megatron-core "
                      "equivalent; set it to false if the model was trained without them")
    heads = _positive_int(cfg, "num_attention_heads")
    kv_heads = _positive_int(cfg, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise _refuse("num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}")
    hidden = _positive_int(cfg, "hidden_size")
    head_dim = _positive_int(cfg, "head_dim", default=max(hidden // heads, 1))
    theta, factor = _rope_from_hf(cfg)
    tied = cfg.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise ValueError(f"config.json field tie_word_embeddings={tied!r}: must be true or false; fix config.json")
    sliding_window = _positive_int(cfg, "sliding_window", default=0) if model_type == "mistral" else 0
    return LlamaArchitecture(
        model_type=model_type, vocab_size=_positive_int(cfg, "vocab_size"), hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size"), num_layers=_positive_int(cfg, "num_hidden_layers"),
        num_attention_heads=heads, num_query_groups=kv_heads, head_dim=head_dim,
        rms_norm_eps=_positive_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"), rope_theta=theta,
        max_position_embeddings=_positive_int(cfg, "max_position_embeddings", default=4096),
        rope_scaling_factor=factor, qkv_bias=model_type == "qwen2", tie_word_embeddings=tied,
        sliding_window=sliding_window or None,
    )


def hf_config_from_architecture(arch: LlamaArchitecture, torch_dtype: str = "float32") -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict describing ``arch`` (legacy-compatible field names)."""
    cfg: dict[str, Any] = {
        "architectures": [SUPPORTED_MODEL_TYPES[arch.model_type]], "model_type": arch.model_type,
        "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_query_groups,
        "head_dim": arch.head_dim, "hidden_act": "silu", "rms_norm_eps": arch.rms_norm_eps,
        "max_position_embeddings": arch.max_position_embeddings, "rope_theta": arch.rope_theta,
        "tie_word_embeddings": arch.tie_word_embeddings, "torch_dtype": torch_dtype,
    }
    if arch.rope_scaling_factor is not None:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": arch.rope_scaling_factor,
                               **MCORE_LLAMA3_ROPE_CONSTANTS}
    if arch.model_type == "mistral":
        cfg["sliding_window"] = arch.sliding_window
    if arch.model_type == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def transformer_config_kwargs(arch: LlamaArchitecture) -> dict[str, Any]:
    """``TransformerConfig`` fields that make a megatron-core decoder compute what HF computes."""
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim, normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        rotary_interleaved=False,
    )
    if arch.sliding_window is not None and arch.sliding_window < arch.max_position_embeddings:
        kwargs["window_size"] = (arch.sliding_window - 1, 0)  # HF: key j visible iff i - j < window
    return kwargs


def gpt_model_kwargs(arch: LlamaArchitecture) -> dict[str, Any]:
    """``GPTModel`` constructor arguments (besides config and layer spec) for ``arch``."""
    return dict(
        vocab_size=arch.vocab_size, max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor if arch.rope_scaling_factor is not None else 8.0,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
    )


def build_gpt_model(arch: LlamaArchitecture, layer_spec: Any = None, *, params_dtype: torch.dtype = torch.float32,
                    **config_overrides: Any) -> torch.nn.Module:
    """A megatron-core ``GPTModel`` for ``arch``: this rank's pipeline stage on the current parallel state.

    ``layer_spec`` defaults to megatron-core's local spec with RMSNorm; ``config_overrides`` are
    extra ``TransformerConfig`` fields (``tensor_model_parallel_size``, ``context_parallel_size``,
    ``pipeline_model_parallel_size``, ...), which must agree with the initialised parallel state.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if layer_spec is None:
        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    kwargs = transformer_config_kwargs(arch)
    kwargs.update(params_dtype=params_dtype, pipeline_dtype=params_dtype,
                  use_cpu_initialization=not torch.cuda.is_available(),
                  bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16)
    kwargs.update(config_overrides)
    config = TransformerConfig(**kwargs)
    return GPTModel(config, layer_spec, pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
                    post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
                    **gpt_model_kwargs(arch))

