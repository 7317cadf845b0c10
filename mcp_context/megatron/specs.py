"""GPT layer specs with hierarchical context-parallel attention, for megatron-core and Megatron-LM.

``get_gpt_layer_hcp_spec()`` is megatron-core's GPT layer spec with one piece swapped: the core
attention is ``HCPDotProductAttention``. Everything else (linears, norms, MLP, MoE) is megatron-core's
own, so parameter names and checkpoints are unchanged. The TE flavour takes TE's fused linears and
norms and either our attention or TE's own ``TEDotProductAttention`` (for the cp_comm_type values TE
supports).

Megatron-LM's ``pretrain_gpt.py --spec mcp_context.megatron.specs NAME`` reads ``NAME`` from the
module's namespace (megatron-core's ``spec_utils.import_module``: ``vars(module)[NAME]``) and uses it
as a spec without calling it, so every name in ``SPEC_NAMES`` is a plain module attribute: one
local spec per layer structure in ``spec_facts.SPEC_VARIANTS`` (``hcp_local_spec``, ``hcp_qknorm_local_spec``,
``hcp_moe_local_spec``, ``hcp_qknorm_moe_local_spec``, ``hcp_mla_local_spec``, ``hcp_mla_moe_local_spec``),
each refusing at model build a config it does not represent; ``hcp_te_spec`` / ``hcp_te_attention_spec`` built at import when
Transformer Engine is importable, else an ``UnavailableSpec`` whose use raises a clear error.
Dense layers among MoE ones need one spec per layer, built from the config: ``get_gpt_decoder_block_hcp_spec``
(no module-level name: ``--spec`` objects exist before the config).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from .core_attention import HCPDotProductAttention
from .spec_facts import SPEC_VARIANTS, LayerSpecFacts

CORE_ATTENTIONS = ("hcp", "te")
MOE_PLACEHOLDER_EXPERTS = 2  # megatron-core's spec only asks whether there are experts; the config gives how many


def get_gpt_layer_hcp_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                           qk_layernorm: bool = False, normalization: str = "RMSNorm", use_te: bool = False,
                           core_attention: str = "hcp", qk_l2_norm: bool = False,
                           multi_latent_attention: bool = False, step_graphs: bool = False) -> ModuleSpec:
    """A GPT transformer-layer spec whose attention is context-parallel on any device.

    The arguments are megatron-core's ``get_gpt_layer_local_spec`` ones and build the same layer (q/k
    LayerNorm or L2 norm, MoE with local experts, MLA). ``use_te``: Transformer Engine linears and norms
    (needs TE). ``core_attention``: ``"hcp"`` (ours, every cp_comm_type and hierarchy depth) or ``"te"``
    (TE's ``TEDotProductAttention``, only with ``use_te``). With ours, the spec carries the structure it
    builds (``LayerSpecFacts``) and the model's config is checked against it at build time. ``step_graphs``:
    our attention replays each shard shape's step from CUDA graphs (``algorithms/graphs.py``; CUDA, comm types
    a2a/all_gather/a2a+all_gather, attention_dropout 0; anything else is refused at the first call; not yet
    run on a GPU).
    """
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"core_attention={core_attention!r} is not one of {', '.join(CORE_ATTENTIONS)}")
    if core_attention == "te" and not use_te:
        raise ValueError("core_attention='te' (TEDotProductAttention) needs use_te=True")
    layer_args = dict(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm,
                      qk_l2_norm=qk_l2_norm, multi_latent_attention=multi_latent_attention)
    if use_te:
        if _te_import_error() is not None:
            raise RuntimeError("get_gpt_layer_hcp_spec(use_te=True) needs Transformer Engine, which is not "
                               "importable here; install mcp_context[te] on a CUDA machine, or use the local "
                               "flavour (use_te=False, spec name hcp_local_spec)")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(**layer_args)
        if core_attention == "te":
            return spec
    else:
        spec = get_gpt_layer_local_spec(normalization=normalization, **layer_args)
    facts = LayerSpecFacts(qk_layernorm=qk_layernorm, qk_l2_norm=qk_l2_norm, moe=num_experts is not None,
                           moe_grouped_gemm=num_experts is not None and moe_grouped_gemm,
                           multi_latent_attention=multi_latent_attention, use_te=use_te)
    return _with_core_attention(spec, dataclasses.replace(facts, name=facts.getter_call()), step_graphs)


def get_gpt_decoder_block_hcp_spec(config: Any, use_te: bool = False, normalization: Optional[str] = None,
                                   qk_l2_norm: bool = False, vp_stage: Optional[int] = None,
                                   pp_rank: Optional[int] = None, step_graphs: bool = False
                                   ) -> TransformerBlockSubmodules:
    """The decoder block of ``config`` with one layer spec per layer, our core attention in each: megatron-core's
    ``get_gpt_decoder_block_spec`` (dense and MoE layers as ``config.moe_layer_freq`` says, e.g. DeepSeek-V3's
    dense first layers, Qwen3-MoE's ``mlp_only_layers``; this pipeline stage's layers only), the same arguments.
    ``GPTModel`` takes it where it takes a layer spec. Each layer checks the config against the block's structure.
    ``step_graphs``: as in ``get_gpt_layer_hcp_spec``."""
    if use_te and _te_import_error() is not None:
        raise RuntimeError("get_gpt_decoder_block_hcp_spec(use_te=True) needs Transformer Engine, which is not "
                           "importable here; install mcp_context[te] on a CUDA machine, or use use_te=False")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=normalization,
                                       qk_l2_norm=qk_l2_norm, vp_stage=vp_stage, pp_rank=pp_rank)
    freq = config.moe_layer_freq
    facts = LayerSpecFacts(qk_layernorm=bool(config.qk_layernorm), qk_l2_norm=qk_l2_norm,
                           moe=config.num_moe_experts is not None, moe_grouped_gemm=bool(config.moe_grouped_gemm),
                           multi_latent_attention=bool(config.multi_latent_attention), use_te=use_te,
                           moe_layer_freq=tuple(freq) if isinstance(freq, list) else freq)
    facts = dataclasses.replace(facts, name=facts.getter_call())
    return dataclasses.replace(block, layer_specs=[_with_core_attention(spec, facts, step_graphs)
                                                   for spec in block.layer_specs])


def _with_core_attention(spec: ModuleSpec, facts: LayerSpecFacts, step_graphs: bool = False) -> ModuleSpec:
    """``spec`` with our core attention, which checks the model's config against ``facts`` when built."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=HCPDotProductAttention, params={"layer_spec": facts, "step_graphs": step_graphs})
    return spec


def _variant(facts: LayerSpecFacts) -> ModuleSpec:
    """The module-level spec for one row of ``SPEC_VARIANTS``."""
    return _named(get_gpt_layer_hcp_spec(num_experts=MOE_PLACEHOLDER_EXPERTS if facts.moe else None,
                                         qk_layernorm=facts.qk_layernorm, qk_l2_norm=facts.qk_l2_norm,
                                         multi_latent_attention=facts.multi_latent_attention), facts.name)


def _named(spec: ModuleSpec, name: str) -> ModuleSpec:
    """``spec``, whose refusals call it by its --spec name."""
    params = spec.submodules.self_attention.submodules.core_attention.params
    params["layer_spec"] = dataclasses.replace(params["layer_spec"], name=name)
    return spec


class UnavailableSpec(ModuleSpec):
    """A spec name that exists without Transformer Engine but cannot be built: any use (reading
    ``module``/``submodules``/``params``, or building it) raises a ``RuntimeError`` that says what to
    install or which spec to use instead.

    megatron-core's ``spec_utils.import_module`` (behind Megatron-LM's ``--spec MODULE NAME``) reads
    ``vars(module)[NAME]``, so every documented name must be a real module attribute, not a lazy one.
    """

    def __init__(self, name: str, reason: str):  # no ModuleSpec fields: each access raises
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_reason", reason)

    def _unavailable(self):
        raise RuntimeError(
            f"layer spec {__name__}.{self._name} needs Transformer Engine, which is not importable here "
            f"({self._reason}); install mcp_context[te] on a CUDA machine, or use "
            f"--spec {__name__} hcp_local_spec with --transformer-impl local"
        )

    module = property(_unavailable)
    submodules = property(_unavailable)
    params = property(_unavailable)
    metainfo = property(_unavailable)

    def __repr__(self) -> str:
        return f"UnavailableSpec({self._name!r}: needs Transformer Engine)"

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__


def _te_import_error() -> Optional[str]:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as err:
        return f"{type(err).__name__}: {err}"
    return None


# Local (torch) layers, our attention, any device; one object per layer structure (spec_facts.SPEC_VARIANTS).
hcp_local_spec = _variant(SPEC_VARIANTS["hcp_local_spec"])
"""Dense MLP, no q/k norm: Llama, Mistral; sinks (softmax_type) and windows come from the config."""
hcp_qknorm_local_spec = _variant(SPEC_VARIANTS["hcp_qknorm_local_spec"])
"""q/k LayerNorm (qk_layernorm=True), dense MLP: Qwen3."""
hcp_moe_local_spec = _variant(SPEC_VARIANTS["hcp_moe_local_spec"])
"""MoE with megatron-core's local experts in every layer: Mixtral, gpt-oss."""
hcp_qknorm_moe_local_spec = _variant(SPEC_VARIANTS["hcp_qknorm_moe_local_spec"])
"""q/k LayerNorm and MoE: Qwen3-MoE."""
hcp_mla_local_spec = _variant(SPEC_VARIANTS["hcp_mla_local_spec"])
"""Multi-latent attention with its latent norms (qk_layernorm=True), dense MLP: an MLATransformerConfig."""
hcp_mla_moe_local_spec = _variant(SPEC_VARIANTS["hcp_mla_moe_local_spec"])
"""Multi-latent attention with latent norms and MoE in every layer: DeepSeek-V3-style (moe_layer_freq=1)."""

_TE_SPECS = {"hcp_te_spec": dict(use_te=True), "hcp_te_attention_spec": dict(use_te=True, core_attention="te")}
_TE_MISSING = _te_import_error()
if _TE_MISSING is None:
    hcp_te_spec = _named(get_gpt_layer_hcp_spec(**_TE_SPECS["hcp_te_spec"]), "hcp_te_spec")
    """Transformer Engine linears and norms, our attention."""
    hcp_te_attention_spec = get_gpt_layer_hcp_spec(**_TE_SPECS["hcp_te_attention_spec"])
    """Transformer Engine linears and norms, and TE's own TEDotProductAttention."""
else:
    hcp_te_spec = UnavailableSpec("hcp_te_spec", _TE_MISSING)
    hcp_te_attention_spec = UnavailableSpec("hcp_te_attention_spec", _TE_MISSING)

SPEC_NAMES = (*SPEC_VARIANTS, *_TE_SPECS)
"""Every module-level spec, as Megatron-LM's ``--spec mcp_context.megatron.specs NAME`` names it."""
