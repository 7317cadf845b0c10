"""What a layer spec builds, and the check that a model's config is one the spec represents.

A layer spec fixes the layer's structure (q/k norms, MoE or dense MLP, MLA or plain attention) when it
is built, but the config decides what the model is meant to be. Megatron-LM's ``--spec MODULE NAME``
uses a spec object built once at import, so a config with ``qk_layernorm=True`` or ``num_moe_experts``
would otherwise build a model without q/k norms or without experts, silently. Each spec from
``get_gpt_layer_hcp_spec`` carries its ``LayerSpecFacts`` in its core attention's ``params``; the core
attention receives the config at model build and refuses, naming the field and the spec or getter
call that serves it. ``SPEC_VARIANTS`` is the table of module-level spec names (``specs.py`` builds
one object per row).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .config import HCPConfigError

SPEC_MODULE = "mcp_context.megatron.specs"


@dataclass(frozen=True)
class LayerSpecFacts:
    """The structure a layer spec builds. ``name``: how a user names it (a module-level spec or a getter call)."""
    name: str = ""
    qk_layernorm: bool = False
    qk_l2_norm: bool = False
    moe: bool = False
    moe_grouped_gemm: bool = False
    multi_latent_attention: bool = False
    use_te: bool = False
    moe_layer_freq: Any = 1
    """The MoE layers of the block the spec builds (megatron-core's ``moe_layer_freq``, a list as a tuple): 1 for a
    layer spec (every layer alike), the config's pattern for ``get_gpt_decoder_block_hcp_spec``'s layers."""

    def getter_call(self) -> str:
        """The ``get_gpt_layer_hcp_spec(...)`` (or, for a per-layer block, ``get_gpt_decoder_block_hcp_spec``)
        call that builds this structure."""
        if self.moe_layer_freq != 1:
            return "get_gpt_decoder_block_hcp_spec(config)"
        args = [f"{f.name}=True" for f in dataclasses.fields(self) if f.name not in ("name", "moe", "moe_layer_freq")
                and getattr(self, f.name)]
        if self.moe:
            args.insert(0, "num_experts=<num_moe_experts>")
        return f"get_gpt_layer_hcp_spec({', '.join(args)})"

    def structure(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name")


# Module-level specs for Megatron-LM's --spec (local layers, our attention), by the structure each builds.
SPEC_VARIANTS: dict[str, LayerSpecFacts] = {
    "hcp_local_spec": LayerSpecFacts(),  # Llama, Mistral, gpt-oss-style dense with sinks/windows
    "hcp_qknorm_local_spec": LayerSpecFacts(qk_layernorm=True),  # Qwen3 dense
    "hcp_moe_local_spec": LayerSpecFacts(moe=True),  # Mixtral, gpt-oss
    "hcp_qknorm_moe_local_spec": LayerSpecFacts(qk_layernorm=True, moe=True),  # Qwen3-MoE
    "hcp_mla_local_spec": LayerSpecFacts(multi_latent_attention=True, qk_layernorm=True),  # MLA, latent norms
    "hcp_mla_moe_local_spec": LayerSpecFacts(multi_latent_attention=True, qk_layernorm=True, moe=True),  # DeepSeek-V3
}
SPEC_VARIANTS = {name: dataclasses.replace(facts, name=name) for name, facts in SPEC_VARIANTS.items()}


def facts_of_config(config: Any, use_te: bool = False) -> LayerSpecFacts:
    """The structure ``config`` asks a layer to have."""
    moe = config.num_moe_experts is not None
    return LayerSpecFacts(qk_layernorm=bool(config.qk_layernorm), qk_l2_norm=bool(config.qk_l2_norm), moe=moe,
                          moe_grouped_gemm=moe and bool(config.moe_grouped_gemm),
                          multi_latent_attention=bool(config.multi_latent_attention), use_te=use_te)


def serving_spec(wanted: LayerSpecFacts) -> str:
    """How to get a spec with ``wanted``'s structure: the --spec name if one exists, and the getter call."""
    for name, facts in SPEC_VARIANTS.items():
        if facts.structure() == wanted.structure():
            return f"--spec {SPEC_MODULE} {name} (or {wanted.getter_call()})"
    return wanted.getter_call()


_WHAT = {  # field -> (what the spec builds when True, when False); the most fundamental first
    "multi_latent_attention": ("multi-latent attention (MLA)", "plain (GQA) attention"),
    "moe": ("a MoE MLP", "a dense MLP"),
    "moe_grouped_gemm": ("grouped-GEMM experts", "sequential local experts"),
    "qk_layernorm": ("q/k norms", "no q/k norms"),
    "qk_l2_norm": ("q/k L2 norms", "no q/k L2 norms"),
}
_CONFIG_FIELD = {"moe": "num_moe_experts"}


def check_spec_fits(config: Any, facts: LayerSpecFacts) -> None:
    """Raise ``HCPConfigError`` when ``config`` asks for a layer structure that ``facts``' spec does not build."""
    wanted = facts_of_config(config, use_te=facts.use_te)
    for field, (built_true, built_false) in _WHAT.items():
        if getattr(wanted, field) != getattr(facts, field):
            config_field = _CONFIG_FIELD.get(field, field)
            value = getattr(config, config_field)
            raise HCPConfigError(
                f"TransformerConfig.{config_field}={value!r}, but layer spec {facts.name or facts.getter_call()} "
                f"builds {built_true if getattr(facts, field) else built_false}: the model would not be the one "
                f"configured; use {serving_spec(wanted)}")
    freq = getattr(config, "moe_layer_freq", 1)
    freq = tuple(freq) if isinstance(freq, list) else freq
    if facts.moe and freq != facts.moe_layer_freq:
        built = "the MoE MLP in every layer" if facts.moe_layer_freq == 1 else \
            f"MoE layers as moe_layer_freq={list(facts.moe_layer_freq)!r}"
        raise HCPConfigError(
            f"TransformerConfig.moe_layer_freq={getattr(config, 'moe_layer_freq')!r}, but layer spec "
            f"{facts.name or facts.getter_call()} puts {built}; for dense layers among MoE ones build the block "
            f"with mcp_context.megatron.specs.get_gpt_decoder_block_hcp_spec(config) (one layer spec per layer)")
