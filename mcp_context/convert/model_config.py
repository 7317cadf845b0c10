"""Hugging Face decoder ``config.json`` <-> the package's model shape (``ModelConfig``).

Families: dense Llama-style decoders (Llama, Mistral, Qwen2), Qwen3 (per-head q/k RMSNorm:
``qk_layernorm``) and the softmax-routed mixtures of experts Mixtral and Qwen3-MoE (megatron-core's
local experts, ``num_moe_experts`` / ``moe_router_topk`` / ``moe_router_pre_softmax``), gpt-oss
(learned sinks ``softmax_type='learnable'``, windows per ``layer_types``, biases on every linear, the
clamped quick-GELU GLU with an offset) and DeepSeek-V3 (MLA, sigmoid group routing); YaRN RoPE and dense
layers among MoE ones (``moe_layer_freq`` lists) in any of them. ``config.json`` is read through the installed
transformers' config class, so an absent field is the value transformers computes with.

Owns :class:`HFModel` (a model's shape in megatron-core's names, plus ``model_type``, the one fact
only the Hugging Face side needs), the reading of ``config.json`` into it with its validation against
what megatron-core can represent, the writing of ``config.json`` from it, and the architecture record
a converted checkpoint carries. Unsupported features (other model types, biases Megatron cannot
place, RoPE variants megatron-core 0.16 lacks) are refused with an error naming the config field, its
value and what to do; nothing is dropped quietly. The translation of the shape into
``TransformerConfig`` / ``GPTModel`` arguments is the recipes' (``mcp_context.recipes.schema``), the
same one pretraining uses. It does not touch weights (``mapping``) or files (``hf_io``, ``mcore_io``).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from mcp_context.recipes.schema import ModelConfig

SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                         "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                         "deepseek_v3": "DeepseekV3ForCausalLM"}
# How each family's config.json says which layers slide: on every layer (``sliding_window``; Qwen3-MoE
# only with ``use_sliding_window``), or per layer (Qwen2's ``layer_types`` / ``max_window_layers``).
EVERY_LAYER_WINDOW = ("mistral", "mixtral", "qwen3_moe")
PER_LAYER_WINDOW = ("qwen2", "qwen3")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
MOE_TYPES = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3")
# gpt-oss's GLU: gate * sigmoid(alpha * gate), which is megatron-core's quick_gelu only at this alpha.
QUICK_GELU_ALPHA = 1.702
# megatron-core's RotaryEmbedding._apply_scaling hard-codes these Llama-3 constants; only `factor`
# is configurable (GPTModel(rope_scaling=True, rope_scaling_factor=...)).
MCORE_LLAMA3_ROPE_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}
# The fields of the architecture record converters before the shared ModelConfig wrote; such a
# record still loads (``HFModel.from_record``), through the config.json it stands for.
_LEGACY_RECORD_FIELDS = {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                         "num_attention_heads", "num_query_groups", "head_dim", "rms_norm_eps", "rope_theta",
                         "max_position_embeddings", "rope_scaling_factor", "qkv_bias", "tie_word_embeddings",
                         "sliding_window"}


class UnsupportedArchitectureError(ValueError):
    """The Hugging Face config describes a model this converter cannot represent in Megatron-Core."""


@dataclass(frozen=True)
class HFModel:
    """A decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE) as the converter sees it: its
    shape (TP = PP = CP = 1; a loader sets its own layout) and its Hugging Face ``model_type``."""

    model_type: str
    shape: ModelConfig

    def to_record(self) -> dict[str, Any]:
        """The architecture record a converted checkpoint carries (JSON-ready)."""
        return {"model_type": self.model_type, "shape": dataclasses.asdict(self.shape)}

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> "HFModel":
        """Inverse of :meth:`to_record`; a record in the earlier flat format is read through the
        ``config.json`` it describes, so checkpoints converted before still load."""
        if set(data) <= _LEGACY_RECORD_FIELDS and "model_type" in data:
            return hf_model_from_config(_legacy_record_to_hf_config(data))
        shape = data.get("shape") if isinstance(data.get("shape"), dict) else {}
        unknown = sorted(set(data) - {"model_type", "shape"}) + sorted(
            f"shape.{name}" for name in set(shape) - {f.name for f in dataclasses.fields(ModelConfig)})
        missing = sorted({"model_type", "shape"} - set(data)) or ([] if shape else ["shape (a mapping)"])
        if unknown or missing:
            raise ValueError(f"architecture record has unknown fields {unknown} and lacks fields {missing}; it "
                             f"was written by a different version of mcp_context.convert")
        return cls(data["model_type"], ModelConfig(**shape))


def _legacy_record_to_hf_config(data: dict[str, Any]) -> dict[str, Any]:
    names = {"num_layers": "num_hidden_layers", "num_query_groups": "num_key_value_heads"}
    cfg = {names.get(k, k): v for k, v in data.items()
           if k not in ("rope_scaling_factor", "qkv_bias", "sliding_window")}
    if data.get("rope_scaling_factor") is not None:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": data["rope_scaling_factor"], **MCORE_LLAMA3_ROPE_CONSTANTS}
    if data.get("model_type") == "mistral":
        cfg["sliding_window"] = data.get("sliding_window")
    return cfg


def _refuse(field: str, value: Any, why: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"config.json field {field}={value!r}: {why}")


def _positive_int(cfg: dict[str, Any], field: str, default: Optional[int] = None) -> int:
    """``cfg[field]`` as an integer >= 1; absent or null means ``default`` (required when None)."""
    value = cfg.get(field)
    if value is None and default is not None:
        return default
    if value is None and field not in cfg:
        raise ValueError(f"config.json has no field {field}; this model type's config needs it (an integer >= 1)")
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or value < 1:
        raise ValueError(f"config.json field {field}={value!r}: must be an integer >= 1; fix config.json")
    return int(value)


def _positive_float(value: Any, field: str) -> float:
    """``value`` (of config field ``field``) as a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"config.json field {field}={value!r}: must be a finite number > 0; fix config.json")
    return float(value)


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of either the transformers-5 ``rope_parameters`` dict or the older top-level
    ``rope_theta`` / ``rope_scaling`` fields (``type`` spelled ``rope_type``)."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params["rope_theta"] = _positive_float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta")
    return params


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1), as both sides
    compute it (transformers' ``get_mscale``, megatron-core's ``_yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_from_hf(cfg: dict[str, Any], params: dict[str, Any], mla: bool) -> dict[str, Any]:
    """transformers' YaRN (``_compute_yarn_parameters``) as megatron-core's: the inverse frequencies blend the
    plain and the factor-scaled ones over the correction range of ``beta_fast`` / ``beta_slow`` rotations at
    ``original_max_position_embeddings`` (rounded to whole dims unless ``truncate`` is false), and cos / sin are
    scaled by the attention factor, ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are
    set, else ``mscale(factor)``. Without MLA these are the ``yarn_*`` fields (``GPTModel``'s YaRN); with MLA
    (DeepSeek-V3) ``MLATransformerConfig``'s, whose softmax scale also takes ``mscale(factor, mscale_all_dim)^2``
    as transformers' DeepSeek attention does. Settings the Megatron side would compute otherwise are refused."""
    if params.get("original_max_position_embeddings") is None:
        raise _refuse("rope_parameters.original_max_position_embeddings", None, "YaRN needs the pre-extension "
                      "context length; set it in rope_parameters")
    original = _positive_int(params, "original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and not mla:  # transformers' rule; DeepSeek's attention scale reads factor itself
        factor = _positive_int(cfg, "max_position_embeddings", default=4096) / original
    factor = _positive_float(factor, "rope_parameters.factor")
    beta_fast = _positive_float(params.get("beta_fast") or 32.0, "rope_parameters.beta_fast")
    beta_slow = _positive_float(params.get("beta_slow") or 1.0, "rope_parameters.beta_slow")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise _refuse("rope_parameters.truncate", truncate, "must be true or false")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    for name, value in (("mscale", mscale), ("mscale_all_dim", all_dim)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise _refuse(f"rope_parameters.{name}", value, "must be a number >= 0")
    ours = (float(mscale), float(all_dim)) if mscale and all_dim else (1.0, float(all_dim or 0.0) if mla else 0.0)
    theirs = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) if mscale and all_dim else yarn_mscale(factor)
    if params.get("attention_factor") is not None:
        theirs = _positive_float(params["attention_factor"], "rope_parameters.attention_factor")
    if not math.isclose(yarn_mscale(factor, ours[0]) / yarn_mscale(factor, ours[1]), theirs, rel_tol=1e-12):
        field = "attention_factor" if params.get("attention_factor") is not None else "mscale"
        raise _refuse(f"rope_parameters.{field}", params.get(field), f"transformers scales cos/sin by {theirs:.6g}; "
                      f"megatron-core computes mscale(factor, mscale) / mscale(factor, mscale_all_dim) and cannot "
                      f"give that from these fields (mscale={mscale!r}, mscale_all_dim={all_dim!r})")
    if mla:
        if not truncate:
            raise _refuse("rope_parameters.truncate", truncate, "megatron-core's MLA YaRN always rounds the "
                          "correction range to whole dims (truncate=true)")
        return dict(rope_type="yarn", rotary_scaling_factor=factor, original_max_position_embeddings=original,
                    beta_fast=beta_fast, beta_slow=beta_slow, mscale=ours[0], mscale_all_dim=ours[1])
    return dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=factor,
                yarn_original_max_position_embeddings=original, yarn_beta_fast=beta_fast, yarn_beta_slow=beta_slow,
                yarn_mscale=ours[0], yarn_mscale_all_dim=ours[1], yarn_correction_range_round_to_int=truncate)


def _rope_from_hf(cfg: dict[str, Any], mla: bool = False) -> dict[str, Any]:
    """The ``ModelConfig`` RoPE fields of a config: plain RoPE (``rotary_base``), Llama-3 scaling
    (``rope_scaling``) or YaRN (``_yarn_from_hf``); MLA's without Llama-3 scaling (its attention applies RoPE)."""
    params = _rope_parameters(cfg)
    rope_type, theta = params["rope_type"], params["rope_theta"]
    if rope_type == "default":
        return dict(rotary_base=theta, **({"rope_type": "rope"} if mla else {}))
    if rope_type == "yarn":
        return dict(rotary_base=theta, **_yarn_from_hf(cfg, params, mla))
    if rope_type != "llama3" or mla:
        raise _refuse("rope_scaling.rope_type", rope_type,
                      "megatron-core 0.16 represents plain RoPE ('default'), Llama-3 scaling ('llama3', not with MLA) "
                      "and YaRN ('yarn'); convert a model without this RoPE variant")
    for name, expected in MCORE_LLAMA3_ROPE_CONSTANTS.items():
        if params.get(name, expected) != expected:
            raise _refuse(f"rope_scaling.{name}", params[name],
                          f"megatron-core 0.16 hard-codes {name}={expected} for Llama-3 RoPE scaling "
                          f"(only 'factor' is configurable), so this model cannot be represented")
    return dict(rotary_base=theta, rope_scaling=True,
                rope_scaling_factor=_positive_float(params.get("factor"), "rope_scaling.factor"))


def _flag(cfg: dict[str, Any], field: str, default: bool) -> bool:
    """``cfg[field]`` as a bool (absent: ``default``)."""
    value = cfg.get(field, default)
    if not isinstance(value, bool):
        raise ValueError(f"config.json field {field}={value!r}: must be true or false; fix config.json")
    return value


def _layer_types(cfg: dict[str, Any], num_layers: int, default: Optional[list[str]] = None) -> list[bool]:
    """``layer_types`` (absent: ``default``) as one bool per layer, True where it slides."""
    types = cfg.get("layer_types")
    types = default if types is None else types
    if not isinstance(types, list) or len(types) != num_layers or \
            any(t not in ("full_attention", "sliding_attention") for t in types):
        raise _refuse("layer_types", types, f"must list 'full_attention' or 'sliding_attention' for each of the "
                      f"num_hidden_layers={num_layers} layers")
    return [t == "sliding_attention" for t in types]


def _sliding_layers(cfg: dict[str, Any], num_layers: int) -> list[bool]:
    """Which layers of a Qwen2 / Qwen3 config slide, as transformers 5 decides: an explicit ``layer_types``
    wins; otherwise layers ``i >= max_window_layers`` when ``use_sliding_window``."""
    use = _flag(cfg, "use_sliding_window", False)
    if cfg.get("layer_types") is None:
        first = cfg.get("max_window_layers", 28)  # Qwen2Config's default
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"config.json field max_window_layers={first!r}: must be an integer >= 0; "
                             f"fix config.json")
        return [use and i >= first for i in range(num_layers)]
    sliding = _layer_types(cfg, num_layers)
    if any(sliding) and not use:
        raise _refuse("layer_types", cfg["layer_types"], "names sliding_attention layers but use_sliding_window "
                      "is false, so transformers has no window for them; set use_sliding_window=true (with "
                      "sliding_window) or make them full_attention")
    return sliding


def _window_from_hf(cfg: dict[str, Any], model_type: str, num_layers: int,
                    max_positions: int) -> tuple[Optional[list[int]], Optional[list[int]]]:
    """``(window_size, window_attn_skip_freq)`` of the config's sliding-window layers.

    transformers lets query i see key j of a sliding layer iff ``0 <= i - j < sliding_window``
    (``masking_utils.sliding_window_overlay`` on the causal mask): ``window_size = [w - 1, 0]``. Mistral
    and Mixtral slide on every layer, Qwen3-MoE on every layer with ``use_sliding_window``, Qwen2 and
    Qwen3 on the layers ``_sliding_layers`` picks; a list of 0/1 says which
    (None: all of them). A window as long as the position table masks nothing and is dropped."""
    if model_type == "gpt_oss":
        sliding = _layer_types(cfg, num_layers, default=["sliding_attention" if i % 2 == 0 else "full_attention"
                                                          for i in range(num_layers)])
    elif model_type in EVERY_LAYER_WINDOW:
        sliding = [model_type != "qwen3_moe" or _flag(cfg, "use_sliding_window", False)] * num_layers
    elif model_type in PER_LAYER_WINDOW:
        sliding = _sliding_layers(cfg, num_layers)
    else:
        return None, None
    if cfg.get("sliding_window", 4096) is None or not any(sliding):
        return None, None
    # the configs' default for an absent field
    width = _positive_int(cfg, "sliding_window", default=128 if model_type == "gpt_oss" else 4096)
    if width >= max_positions:
        return None, None
    return [width - 1, 0], None if all(sliding) else [int(x) for x in sliding]


def _as_transformers_reads(cfg: dict[str, Any]) -> tuple[dict[str, Any], Optional[str]]:
    """``cfg`` with every field the installed transformers' config class holds, an absent one at the value that
    class computes (``to_dict``: e.g. MixtralConfig's ``rms_norm_eps`` 1e-5 and ``sliding_window`` null), so a
    default is the one transformers runs the model with. When transformers refuses the file: ``cfg`` over the
    class's plain defaults and why, for the caller to raise after its own checks, which name the field first."""
    try:
        import transformers
        from transformers import AutoConfig
    except ImportError:
        raise ValueError("reading config.json needs transformers (its config class decides every default the model "
                         "computes with); pip install transformers") from None
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its notes on odd values would break the one-line errors
    try:
        full = AutoConfig.for_model(**copy.deepcopy(cfg)).to_dict()  # it fills nested dicts in place
    except Exception as err:  # strict dataclass validation raises several types
        why = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        return ({**_defaults_without_refused_fields(cfg, AutoConfig), **cfg},
                f"config.json is refused by transformers {transformers.__version__}: {why}")
    finally:
        transformers.logging.set_verbosity(verbosity)
    return {**full, **cfg}, None


# Fields transformers validates together; one refused is left out with the others of its group.
_FIELD_GROUPS = (("rope_parameters", "rope_scaling", "rope_theta"), ("layer_types",))


def _defaults_without_refused_fields(cfg: dict[str, Any], auto_config: Any) -> dict[str, Any]:
    """The class's values for a file transformers refuses: built without the fields its errors name (or the
    RoPE / ``layer_types`` groups, whose checks name none), those left unfilled; {} when that fails too."""
    dropped: set[str] = set()
    for _ in range(1 + len(cfg)):
        try:
            full = auto_config.for_model(**copy.deepcopy({k: v for k, v in cfg.items() if k not in dropped}))
            return {k: v for k, v in full.to_dict().items() if k not in dropped}
        except Exception as err:
            named = re.search(r"field '(\w+)'", str(err))
            groups = [(named.group(1),)] if named and named.group(1) in cfg else []
            group = next((g for g in groups + list(_FIELD_GROUPS) if set(g) & set(cfg) - dropped), None)
            if group is None:
                return {}
            dropped |= set(group)
    return {}


def _check_megatron_builds(model_type: str, shape: ModelConfig) -> None:
    """Refuse a shape megatron-core's ``TransformerConfig`` rejects, now rather than when the model is built."""
    import megatron.core

    from mcp_context.recipes.schema import transformer_config_class, transformer_config_kwargs

    try:
        transformer_config_class(shape)(**transformer_config_kwargs(shape), use_cpu_initialization=True)
    except (ValueError, AssertionError, NotImplementedError) as err:
        raise UnsupportedArchitectureError(
            f"config.json describes a {model_type} that megatron-core {megatron.core.__version__} cannot build "
            f"({type(err).__name__}: {err}); nothing is converted") from None


def hf_model_from_config(cfg: dict[str, Any]) -> HFModel:
    """Validate a Hugging Face ``config.json`` dict, read as the installed transformers reads it, and return its
    :class:`HFModel`; a model megatron-core would not build is refused here."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _refuse("model_type", model_type,
                      f"supported model types are {sorted(SUPPORTED_MODEL_TYPES)}; other architectures need "
                      f"their own converter")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method") if isinstance(cfg["quantization_config"], dict) else None
        raise _refuse("quantization_config", {"quant_method": method}, "quantized weights (gpt-oss's MXFP4 experts, "
                      "DeepSeek-V3's FP8 blocks) are not mapped; dequantize to bf16 first (e.g. load with transformers' "
                      "dequantizing config and save_pretrained) and convert that")
    cfg, refused_by_transformers = _as_transformers_reads(cfg)
    archs = cfg.get("architectures") or [SUPPORTED_MODEL_TYPES[model_type]]
    if archs != [SUPPORTED_MODEL_TYPES[model_type]]:
        raise _refuse("architectures", archs,
                      f"only {SUPPORTED_MODEL_TYPES[model_type]} (the causal-LM head) is supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", cfg["hidden_act"], "Llama-family SwiGLU needs 'silu'")
    if model_type == "gpt_oss" and cfg.get("attention_bias", True) is not True:
        raise _refuse("attention_bias", cfg["attention_bias"], "gpt-oss's experts and router have biases, which "
                      "megatron-core adds only with add_bias_linear, which also puts them on q/k/v/o; "
                      "only attention_bias=true is represented")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag, False) and not (model_type == "gpt_oss" and flag == "attention_bias"):
            raise _refuse(flag, cfg[flag], "biases on all projections are not a Llama-family layout; "
                          "megatron-core places them only through add_bias_linear, which also adds "
                          "biases HF does not have")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse("partial_rotary_factor", cfg["partial_rotary_factor"], "only full RoPE is supported")
    heads = _positive_int(cfg, "num_attention_heads")
    kv_heads = _positive_int(cfg, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise _refuse("num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}")
    hidden = _positive_int(cfg, "hidden_size")
    head_dim = _positive_int(cfg, "head_dim", default=max(hidden // heads, 1))
    if model_type == "deepseek_v3":
        _check_deepseek(cfg)
    rope = _rope_from_hf(cfg, mla=model_type == "deepseek_v3")
    tied = _flag(cfg, "tie_word_embeddings", False)
    max_positions = _positive_int(cfg, "max_position_embeddings", default=4096)
    num_layers = _positive_int(cfg, "num_hidden_layers")
    window, skip_freq = _window_from_hf(cfg, model_type, num_layers, max_positions)
    shape = ModelConfig(
        num_layers=num_layers, hidden_size=hidden,
        ffn_hidden_size=_positive_int(cfg, "intermediate_size"), num_attention_heads=heads,
        num_query_groups=kv_heads, kv_channels=head_dim, seq_length=max_positions,
        max_position_embeddings=max_positions, vocab_size=_positive_int(cfg, "vocab_size"),
        rotary_percent=1.0, **{"position_embedding_type": "rope", **rope},
        share_embeddings_and_output_weights=tied, normalization="RMSNorm",
        layernorm_epsilon=_positive_float(cfg.get("rms_norm_eps"), "rms_norm_eps"),
        gated_linear_unit=True, add_bias_linear=model_type == "gpt_oss", add_qkv_bias=model_type == "qwen2",
        softmax_type="learnable" if model_type == "gpt_oss" else "vanilla",
        **(_gpt_oss_glu(cfg) if model_type == "gpt_oss" else {"activation_func": "silu"}),
        window_size=window, window_attn_skip_freq=skip_freq, attention_dropout=0.0, hidden_dropout=0.0,
        qk_layernorm=model_type in QK_NORM_TYPES, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        context_parallel_size=1, hierarchical_context_parallel_sizes=None, cp_comm_type="p2p",
        **(_moe_from_hf(cfg, model_type, num_layers) if model_type in MOE_TYPES else {}),
    )
    if model_type == "deepseek_v3":
        shape = dataclasses.replace(shape, **_mla_from_hf(cfg))
    if refused_by_transformers:
        raise ValueError(refused_by_transformers)
    _check_megatron_builds(model_type, shape)
    return HFModel(model_type, shape)


def _check_deepseek(cfg: dict[str, Any]) -> None:
    """Refuse the DeepSeek-V3 settings this converter does not represent (or has not proven), by field."""
    if cfg.get("q_lora_rank", 1536) is None:
        raise _refuse("q_lora_rank", None, "a full query projection (q_proj) is not mapped; only the low-rank "
                      "query (q_a_proj, q_a_layernorm, q_b_proj) is")
    for field, need in (("rope_interleave", True), ("norm_topk_prob", True), ("attention_bias", False)):
        if cfg.get(field, need) is not need:
            raise _refuse(field, cfg[field], f"only {field}={need} is represented (megatron-core's sigmoid router "
                          f"always renormalises the top-k; its MLA has no biases and de-interleaves the RoPE dims as "
                          f"rope_interleave=true does)")


def _mla_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's attention as megatron-core's MLA (``MLATransformerConfig``'s fields; RoPE: ``_rope_from_hf``)."""
    return dict(multi_latent_attention=True, qk_layernorm=True, num_query_groups=None, kv_channels=None,
                q_lora_rank=_positive_int(cfg, "q_lora_rank", default=1536),
                kv_lora_rank=_positive_int(cfg, "kv_lora_rank", default=512),
                qk_head_dim=_positive_int(cfg, "qk_nope_head_dim", default=128),
                qk_pos_emb_head_dim=_positive_int(cfg, "qk_rope_head_dim", default=64),
                v_head_dim=_positive_int(cfg, "v_head_dim", default=128))


def _deepseek_router(cfg: dict[str, Any], experts: int, topk: int) -> dict[str, Any]:
    """DeepSeek-V3's MoE: sigmoid scores, the top-k chosen on scores + ``e_score_correction_bias`` among the
    ``topk_group`` best of ``n_group`` groups (a group scored by the sum of its top 2), weights
    renormalised and scaled by ``routed_scaling_factor``; ``n_shared_experts`` shared experts. megatron-core
    scores a group by its top ``topk / group_topk``: the two agree where that is 2 (DeepSeek-V3: 8 / 4)."""
    groups, group_topk = _positive_int(cfg, "n_group", default=8), _positive_int(cfg, "topk_group", default=4)
    if experts % groups or group_topk > groups:
        raise _refuse("n_group", groups, f"must divide n_routed_experts={experts} and be at least "
                      f"topk_group={group_topk}")
    if groups > 1 and topk // group_topk != 2:
        raise _refuse("topk_group", group_topk, f"transformers scores a group by its top 2 experts, megatron-core by "
                      f"its top num_experts_per_tok // topk_group = {topk // group_topk}; they agree only at 2")
    shared = _positive_int(cfg, "n_shared_experts", default=1) if cfg.get("n_shared_experts", 1) else 0
    width = _positive_int(cfg, "moe_intermediate_size", default=2048)
    return dict(num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=width,
                moe_layer_freq=_moe_layer_freq(cfg, "deepseek_v3", _positive_int(cfg, "num_hidden_layers")),
                moe_shared_expert_intermediate_size=shared * width or None, moe_router_score_function="sigmoid",
                moe_router_pre_softmax=False, moe_router_enable_expert_bias=True,
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=group_topk if groups > 1 else None,
                moe_router_topk_scaling_factor=_positive_float(cfg.get("routed_scaling_factor", 2.5),
                                                               "routed_scaling_factor"))


def _gpt_oss_glu(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's expert MLP: ``(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)`` with ``g = clamp(gate, max=l)``,
    which is megatron-core's gated quick_gelu with ``glu_linear_offset=1`` and ``activation_func_clamp_value=l``."""
    alpha = cfg.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise _refuse("swiglu_alpha", alpha, f"megatron-core's quick_gelu hard-codes {QUICK_GELU_ALPHA}")
    limit = _positive_float(cfg.get("swiglu_limit", 7.0), "swiglu_limit")
    return dict(activation_func="quick_gelu", glu_linear_offset=1.0, activation_func_clamp_value=limit)


def _moe_from_hf(cfg: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` MoE fields of a Mixtral / Qwen3-MoE config.

    Both score with a softmax. Mixtral renormalises the top-k scores, which is megatron-core's top-k on
    the logits then a softmax over them (``moe_router_pre_softmax=False``); Qwen3-MoE's ``norm_topk_prob``
    picks between that and the softmax over all experts, kept unnormalised (``pre_softmax=True``). Dense
    layers among the MoE ones are ``moe_layer_freq`` (``_moe_layer_freq``)
    """
    # absent fields take transformers' defaults (MixtralConfig, Qwen3MoeConfig, whose num_experts is an alias)
    experts = _positive_int(cfg, "n_routed_experts", default=256) if model_type == "deepseek_v3" else \
        _positive_int(cfg, "num_local_experts", default={"mixtral": 8, "gpt_oss": 128}.get(model_type) or
                      _positive_int(cfg, "num_experts", default=128))
    topk = _positive_int(cfg, "num_experts_per_tok", default={"mixtral": 2, "gpt_oss": 4}.get(model_type, 8))
    if topk > experts:
        raise _refuse("num_experts_per_tok", topk, f"must be at most the expert count {experts}")
    if model_type == "deepseek_v3":
        return _deepseek_router(cfg, experts, topk)
    if model_type == "gpt_oss":  # top-k on the router's logits, then a softmax over the k
        ffn, pre_softmax = _positive_int(cfg, "intermediate_size"), False
    elif model_type == "mixtral":
        if cfg.get("router_jitter_noise", 0.0) not in (0, 0.0, None):
            raise _refuse("router_jitter_noise", cfg["router_jitter_noise"], "training-time router noise has no "
                          "megatron-core equivalent (moe_input_jitter_eps jitters the input, not the logits); set 0")
        ffn, pre_softmax = _positive_int(cfg, "intermediate_size"), False
    else:
        ffn, pre_softmax = _positive_int(cfg, "moe_intermediate_size"), not _flag(cfg, "norm_topk_prob", False)
    if topk == 1 and not pre_softmax:
        raise _refuse("num_experts_per_tok", topk, "transformers weights the one chosen expert by 1 (its top-1 "
                      "renormalised), which megatron-core's softmax router refuses to compute (\"use "
                      "--moe-router-pre-softmax when topk is 1\", which would weight it by its probability instead); "
                      "only num_experts_per_tok >= 2 is converted")
    return dict(num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=ffn,
                moe_layer_freq=_moe_layer_freq(cfg, model_type, num_layers),
                moe_router_score_function="softmax", moe_router_pre_softmax=pre_softmax)


def _moe_layer_freq(cfg: dict[str, Any], model_type: str, num_layers: int) -> Any:
    """Which layers are MoE, as megatron-core's ``moe_layer_freq``: 1 when all are, else one 0 (dense MLP of
    ``intermediate_size``) or 1 per layer. DeepSeek-V3: the first ``first_k_dense_replace`` layers are dense;
    Qwen3-MoE: layer i is MoE unless listed in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``
    (transformers' rules); Mixtral and gpt-oss: every layer."""
    if model_type == "deepseek_v3":
        first = cfg.get("first_k_dense_replace")
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise _refuse("first_k_dense_replace", first, "must be an integer >= 0")
        pattern, field = [int(i >= first) for i in range(num_layers)], "first_k_dense_replace"
    elif model_type == "qwen3_moe":
        only, step = cfg.get("mlp_only_layers") or [], _positive_int(cfg, "decoder_sparse_step", default=1)
        if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
            raise _refuse("mlp_only_layers", only, "must be a list of layer indices")
        pattern, field = [int(i not in only and (i + 1) % step == 0) for i in range(num_layers)], "mlp_only_layers"
    else:
        return 1
    if not any(pattern):
        raise _refuse(field, cfg.get(field), f"leaves no MoE layer among the num_hidden_layers={num_layers}; convert "
                      f"it as the dense model it is (set the expert fields aside) or keep at least one MoE layer")
    return 1 if all(pattern) else pattern


def hf_config_from_model(model: HFModel, torch_dtype: str = "float32") -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict describing ``model`` (legacy-compatible field names)."""
    m = model.shape
    cfg: dict[str, Any] = {
        "architectures": [SUPPORTED_MODEL_TYPES[model.model_type]], "model_type": model.model_type,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels, "hidden_act": "silu", "rms_norm_eps": m.layernorm_epsilon,
        "max_position_embeddings": m.max_position_embeddings, "rope_theta": float(m.rotary_base),
        "tie_word_embeddings": m.share_embeddings_and_output_weights, "torch_dtype": torch_dtype,
    }
    if m.rope_scaling:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": m.rope_scaling_factor,
                               **MCORE_LLAMA3_ROPE_CONSTANTS}
    if model.model_type in QK_NORM_TYPES:
        cfg["attention_bias"] = False
    if model.model_type == "deepseek_v3":
        cfg.update(_hf_deepseek_fields(m))
    if model.model_type == "gpt_oss":
        cfg.update(attention_bias=True, swiglu_limit=m.activation_func_clamp_value)
    if m.position_embedding_type == "yarn" or model.model_type in ("gpt_oss", "deepseek_v3"):
        del cfg["rope_theta"]  # spelled out in rope_parameters (gpt-oss's and DeepSeek's default RoPE is YaRN)
        cfg["rope_parameters"] = _hf_rope_parameters(m)
    if model.model_type in MOE_TYPES and model.model_type != "deepseek_v3":
        cfg["num_local_experts"], cfg["num_experts_per_tok"] = m.num_moe_experts, m.moe_router_topk
        if model.model_type == "mixtral":
            cfg["router_jitter_noise"] = 0.0
        else:
            cfg.update(moe_intermediate_size=m.moe_ffn_hidden_size, norm_topk_prob=not m.moe_router_pre_softmax,
                       decoder_sparse_step=1, mlp_only_layers=[i for i in range(m.num_layers) if not _is_moe(m, i)])
    cfg.update(_hf_window_fields(model))
    return cfg


def _hf_deepseek_fields(m: ModelConfig) -> dict[str, Any]:
    """A DeepSeek-V3 ``config.json``'s MLA and router fields (MTP layers are not converted: none)."""
    groups = m.moe_router_num_groups or 1
    return {"num_key_value_heads": m.num_attention_heads, "head_dim": m.qk_pos_emb_head_dim,
            "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_head_dim,
            "qk_rope_head_dim": m.qk_pos_emb_head_dim, "v_head_dim": m.v_head_dim, "rope_interleave": True,
            "n_routed_experts": m.num_moe_experts, "num_experts_per_tok": m.moe_router_topk,
            "moe_intermediate_size": m.moe_ffn_hidden_size,
            "n_shared_experts": (m.moe_shared_expert_intermediate_size or 0) // m.moe_ffn_hidden_size,
            "first_k_dense_replace": _first_dense_layers(m), "n_group": groups, "topk_group": m.moe_router_group_topk or 1,
            "norm_topk_prob": True, "routed_scaling_factor": m.moe_router_topk_scaling_factor,
            "attention_bias": False, "num_nextn_predict_layers": 0}


def _is_moe(m: ModelConfig, layer: int) -> bool:
    """Whether ``layer`` is MoE under ``m.moe_layer_freq`` (as megatron-core's block spec reads it)."""
    freq = m.moe_layer_freq
    return bool(freq[layer]) if isinstance(freq, list) else layer % freq == 0


def _first_dense_layers(m: ModelConfig) -> int:
    """DeepSeek-V3's ``first_k_dense_replace`` of ``m``: its dense layers must be the first ones."""
    first = next(i for i in range(m.num_layers) if _is_moe(m, i))
    if not all(_is_moe(m, i) for i in range(first, m.num_layers)):
        raise ValueError(f"moe_layer_freq={m.moe_layer_freq!r} has dense layers after MoE ones, which a DeepSeek-V3 "
                         f"config.json cannot express (first_k_dense_replace: the first k layers dense)")
    return first


def _hf_rope_parameters(m: ModelConfig) -> dict[str, Any]:
    """transformers' ``rope_parameters`` of ``m``'s plain or YaRN RoPE (``_yarn_from_hf`` read backwards)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    if m.position_embedding_type == "yarn":
        params.update(rope_type="yarn", factor=m.yarn_rotary_scaling_factor,
                      original_max_position_embeddings=m.yarn_original_max_position_embeddings,
                      beta_fast=m.yarn_beta_fast, beta_slow=m.yarn_beta_slow,
                      truncate=m.yarn_correction_range_round_to_int)
        if m.yarn_mscale_all_dim:
            params.update(mscale=m.yarn_mscale, mscale_all_dim=m.yarn_mscale_all_dim)
    elif m.multi_latent_attention and m.rope_type == "yarn":
        params.update(rope_type="yarn", factor=m.rotary_scaling_factor,
                      original_max_position_embeddings=m.original_max_position_embeddings,
                      beta_fast=m.beta_fast, beta_slow=m.beta_slow, mscale=m.mscale, mscale_all_dim=m.mscale_all_dim)
    return params


def _hf_window_fields(model: HFModel) -> dict[str, Any]:
    """The ``config.json`` fields of ``model``'s sliding windows: Mistral's and Mixtral's ``sliding_window``
    (Qwen3-MoE's with ``use_sliding_window``); Qwen2's and Qwen3's
    ``use_sliding_window``, ``sliding_window`` and ``layer_types`` (with ``max_window_layers`` where the
    window layers are the upper ones, as Qwen2 counts them). Refuses a window HF cannot express."""
    m, kind = model.shape, model.model_type
    if m.window_size is None:
        if kind == "gpt_oss":  # its config's default alternates windows: say that none slides
            return {"layer_types": ["full_attention"] * m.num_layers}
        if kind in PER_LAYER_WINDOW or kind == "qwen3_moe":
            return {"use_sliding_window": False}
        return {"sliding_window": None} if kind in EVERY_LAYER_WINDOW else {}
    left, right = m.window_size
    freq = m.window_attn_skip_freq  # read as megatron-core's is_layer_window_attention (1-based layers)
    sliding = [freq is None or (bool(freq[i]) if isinstance(freq, list) else (i + 1) % freq != 0)
               for i in range(m.num_layers)]
    if kind == "gpt_oss" and left >= 0 and right == 0:
        return {"sliding_window": left + 1,
                "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}
    if kind not in EVERY_LAYER_WINDOW + PER_LAYER_WINDOW or left < 0 or right != 0 or \
            (kind in EVERY_LAYER_WINDOW and not all(sliding)):
        raise ValueError(f"window_size={m.window_size} with window_attn_skip_freq={freq!r} has no "
                         f"{SUPPORTED_MODEL_TYPES[kind]} config.json spelling (Mistral, Mixtral, Qwen3-MoE: "
                         f"[w - 1, 0] on every layer; Qwen2, Qwen3: [w - 1, 0] on any layers); convert a model "
                         f"without it")
    if kind in EVERY_LAYER_WINDOW:
        return {"sliding_window": left + 1, **({"use_sliding_window": True} if kind == "qwen3_moe" else {})}
    fields: dict[str, Any] = {"use_sliding_window": True, "sliding_window": left + 1,
                              "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}
    first = sliding.index(True) if any(sliding) else m.num_layers
    if all(sliding[first:]):
        fields["max_window_layers"] = first
    return fields
