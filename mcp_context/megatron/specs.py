"""GPT layer specs with hierarchical context-parallel attention, for megatron-core and Megatron-LM.

``get_gpt_layer_hcp_spec()`` is megatron-core's GPT layer spec with one piece swapped: the core
attention is ``HCPDotProductAttention``. Everything else (linears, norms, MLP, MoE) is megatron-core's
own, so parameter names and checkpoints are unchanged. The TE flavour takes TE's fused linears and
norms and either our attention or TE's own ``TEDotProductAttention`` (for the cp_comm_type values TE
supports).

Megatron-LM's ``pretrain_gpt.py --spec mcp_context.megatron.specs NAME`` imports ``NAME`` and uses it
as a spec without calling it, so module-level objects exist too: ``hcp_local_spec`` (always) and
``hcp_te_spec`` / ``hcp_te_attention_spec`` (built on first access; a clear error without TE).
"""
from __future__ import annotations

import copy
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .core_attention import HCPDotProductAttention

CORE_ATTENTIONS = ("hcp", "te")


def _te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def get_gpt_layer_hcp_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                           qk_layernorm: bool = False, normalization: str = "RMSNorm", use_te: bool = False,
                           core_attention: str = "hcp") -> ModuleSpec:
    """A GPT transformer-layer spec whose attention is context-parallel on any device.

    ``use_te``: Transformer Engine linears and norms (needs TE). ``core_attention``: ``"hcp"`` (ours,
    every cp_comm_type and hierarchy depth) or ``"te"`` (TE's ``TEDotProductAttention``, only with
    ``use_te``).
    """
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"core_attention={core_attention!r} is not one of {', '.join(CORE_ATTENTIONS)}")
    if core_attention == "te" and not use_te:
        raise ValueError("core_attention='te' (TEDotProductAttention) needs use_te=True")
    if use_te:
        if not _te_available():
            raise RuntimeError("get_gpt_layer_hcp_spec(use_te=True) needs Transformer Engine, which is not "
                               "importable here; install mcp_context[te] on a CUDA machine, or use the local "
                               "flavour (use_te=False, spec name hcp_local_spec)")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                                          qk_layernorm=qk_layernorm)
        if core_attention == "te":
            return spec
    else:
        spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                        qk_layernorm=qk_layernorm, normalization=normalization)
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = HCPDotProductAttention
    return spec


hcp_local_spec = get_gpt_layer_hcp_spec()

_LAZY = {"hcp_te_spec": dict(use_te=True), "hcp_te_attention_spec": dict(use_te=True, core_attention="te")}


def __getattr__(name: str) -> ModuleSpec:
    """Build the TE specs on first access, so importing this module never needs TE."""
    if name in _LAZY:
        spec = get_gpt_layer_hcp_spec(**_LAZY[name])
        globals()[name] = spec
        return spec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}; layer specs here: hcp_local_spec, "
                         f"{', '.join(_LAZY)}")
