"""Validation of the context-parallel fields of a Megatron ``TransformerConfig``, before anything runs.

megatron-core accepts ``cp_comm_type="bogus"``, hierarchical sizes that do not multiply to the CP
size, and ``a2a+p2p`` without hierarchical groups (upstream then trains with no CP at all). Every
check here works on any object with ``TransformerConfig``'s field names — the config itself, or a
recipe's model section — so recipes and layer specs share one set of checks; the rules themselves
(names, hierarchy sizes, heads, sequence multiple) and their messages are ``mcp_context.cp_rules``'s.
``prefix`` says where the fields live (``"model."`` for a recipe) so messages name the key to fix.
"""
from __future__ import annotations

import difflib
from typing import Any, Optional

from ..cp_rules import (COMM_ALIASES, COMM_TYPES, a2a_degree, check_hcp_sizes, check_heads, check_levels,
                        canonical_comm, check_seq_len, comm_rule, example_hcp_sizes, heads_per_tp_rank, normalize_comm)

ACCEPTED_COMM = COMM_TYPES + tuple(COMM_ALIASES)


class HCPConfigError(ValueError):
    """A context-parallel setting megatron-core would accept but cannot train correctly."""


def _comm_list(config: Any) -> list:
    comm = config.cp_comm_type
    if comm is None:
        return ["p2p"]
    return list(comm) if isinstance(comm, (list, tuple)) else [comm]


def normalize_cp_comm_type(config: Any) -> None:
    """Rewrite the ``allgather`` spelling as ``all_gather`` in place (a string or a per-layer list)."""
    comm = config.cp_comm_type
    if isinstance(comm, (list, tuple)):
        config.cp_comm_type = [canonical_comm(c) for c in comm]
    elif comm is not None:
        config.cp_comm_type = canonical_comm(comm)


def a2a_degree_of(config: Any, comm: str) -> int:
    """Ranks over which one layer's Ulysses all-to-all scatters heads (1: none)."""
    sizes = config.hierarchical_context_parallel_sizes or [config.context_parallel_size]
    return 1 if config.context_parallel_size == 1 else a2a_degree(comm, sizes)


def validate_cp_config(config: Any, seq_length: Optional[int] = None, prefix: str = "") -> None:
    """Raise ``HCPConfigError`` naming the field, its value and the fix for any setting we cannot run."""
    _check_comm(config, prefix)
    _check_hierarchy(config, prefix)
    _check_heads(config, prefix)
    if seq_length is not None:
        _check_seq_length(config, seq_length, prefix)


def _check_comm(config: Any, p: str) -> None:
    comms = _comm_list(config)
    if isinstance(config.cp_comm_type, (list, tuple)) and len(comms) != config.num_layers:
        raise HCPConfigError(f"{p}cp_comm_type is a per-layer list of {len(comms)} entries but "
                             f"{p}num_layers={config.num_layers}; give one entry per layer or a single string")
    for comm in comms:
        try:
            normalize_comm(comm, name=f"{p}cp_comm_type")
        except ValueError as err:
            close = difflib.get_close_matches(str(comm), ACCEPTED_COMM, n=1)
            raise HCPConfigError(str(err) + (f"; did you mean {close[0]!r}?" if close else "")) from None


def _check_hierarchy(config: Any, p: str) -> None:
    cp, sizes = config.context_parallel_size, config.hierarchical_context_parallel_sizes
    if getattr(config, "hybrid_context_parallel", False):
        _check_hybrid(config, p)
        return
    try:
        if sizes is not None:
            check_hcp_sizes(sizes, cp, p)
        for comm in set(_comm_list(config)) if cp > 1 else ():
            check_levels(comm, sizes, comm_name=f"{p}cp_comm_type", sizes_name=f"{p}hierarchical_context_parallel_sizes",
                         fix=f"megatron-core would silently train without context parallelism; set it, e.g. "
                             f"{example_hcp_sizes(cp)}")
    except ValueError as err:
        raise HCPConfigError(str(err)) from None


def _check_hybrid(config: Any, p: str) -> None:
    """Dynamic CP (megatron-core's ``hybrid_context_parallel``): each sub-sample brings its own group out of
    the data x context parallel ranks, so the hierarchy describes that whole group (its product is
    checked against the group when the attention is built) and level 0 is the all-to-all domain."""
    if config.context_parallel_size != 1:
        raise HCPConfigError(f"{p}hybrid_context_parallel=True with {p}context_parallel_size="
                             f"{config.context_parallel_size}: hybrid CP draws each sub-sample's group from the data "
                             f"parallel ranks, and megatron-core's RoPE slices a one-rank sub-sample over the fixed CP "
                             f"group; set {p}context_parallel_size=1 and size the data parallel group instead")
    budget = getattr(config, "max_seqlen_per_dp_cp_rank", None)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise HCPConfigError(f"{p}hybrid_context_parallel=True needs {p}max_seqlen_per_dp_cp_rank, the tokens one rank "
                             f"holds of a sub-sample (got {budget!r}); set it, e.g. to the longest sequence divided by "
                             f"the data parallel size")
    if not getattr(config, "calculate_per_token_loss", False):
        raise HCPConfigError(f"{p}hybrid_context_parallel=True needs {p}calculate_per_token_loss=True: sub-samples "
                             f"differ in length, and megatron-core 0.16's hybrid schedule passes no CP size to the "
                             f"loss (Megatron-LM asserts the same: --calculate-per-token-loss)")
    sizes = config.hierarchical_context_parallel_sizes
    if sizes is not None and (not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes)):
        raise HCPConfigError(f"{p}hierarchical_context_parallel_sizes={sizes} must be a non-empty list of positive "
                             f"integers (inner level first: the all-to-all domain, then the ring)")
    for comm in set(_comm_list(config)):
        try:
            check_levels(comm, sizes, comm_name=f"{p}cp_comm_type", sizes_name=f"{p}hierarchical_context_parallel_sizes",
                         fix="with hybrid_context_parallel it describes the data x context parallel group, level 0 "
                             "being the ranks of one all-to-all domain; set it, e.g. [8, world // 8]")
        except ValueError as err:
            raise HCPConfigError(str(err)) from None


def _check_heads(config: Any, p: str) -> None:
    tp, heads = config.tensor_model_parallel_size, config.num_attention_heads
    try:
        heads_local, groups_local = heads_per_tp_rank(heads, config.num_query_groups or heads, tp, p)
        for comm in set(_comm_list(config)):
            where = (f"{p}hierarchical_context_parallel_sizes[0]" if comm_rule(comm).a2a == "level0"
                     else f"{p}context_parallel_size")
            check_heads(heads_local, groups_local, a2a_degree_of(config, comm), normalize_comm(comm),
                        heads_name=f"query heads per TP rank, {p}num_attention_heads/tensor_model_parallel_size",
                        kv_name=f"key/value heads per TP rank, {p}num_query_groups/tensor_model_parallel_size",
                        degree_name=f"the all-to-all degree {where}")
    except ValueError as err:
        raise HCPConfigError(str(err)) from None


def _check_seq_length(config: Any, seq_length: int, p: str) -> None:
    tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
    if config.sequence_parallel and tp == 1:
        raise HCPConfigError(f"{p}sequence_parallel=true needs {p}tensor_model_parallel_size > 1 (it shards "
                             f"over the TP group); set sequence_parallel to false or raise TP")
    try:
        check_seq_len(seq_length, cp, "zigzag" if cp > 1 else "contiguous", what=f"{p}seq_length",
                      tp=tp if config.sequence_parallel else 1)
    except ValueError as err:
        raise HCPConfigError(str(err)) from None


# ---- attention fields beyond context parallelism (the audit: tests/test_megatron_fields.py) ----

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
# megatron-core's AttnBackend -> our kernel registry's backend.
ATTENTION_BACKENDS = {"flash": "torch:flash", "fused": "torch:cudnn", "unfused": "math", "local": "math",
                      "auto": "auto"}
DETERMINISTIC_CUDA_BACKENDS = ("math",)

# (field, refused when, why and the fix): fields whose meaning our attention cannot deliver.
_NO_MAX_LOGIT = ("needs each head's maximum attention logit from the core attention (current_max_attn_logits), "
                 "which the context-parallel engine does not compute")
_CUDA_GRAPH = ("captures the layer in a CUDA graph; our attention reads packings on the host and checks rank "
               "agreement per call, and has not been captured or run in a graph")
REFUSED_FIELDS = (
    ("qk_clip", bool, f"{_NO_MAX_LOGIT}; set qk_clip=False"),
    ("log_max_attention_logit", bool, f"{_NO_MAX_LOGIT}; set log_max_attention_logit=False"),
    ("fp8_dot_product_attention", bool, "our kernels take bf16/fp16/fp32 q/k/v, not FP8; set it False (FP8 "
                                        "linears, fp8=..., are fine)"),
    ("fp8_multi_head_attention", bool, "our kernels take bf16/fp16/fp32 q/k/v, not FP8; set it False"),
    ("experimental_attention_variant", lambda v: v is not None,
     "replaces softmax attention (gated_delta_net, dsa); mcp_context's specs build softmax attention only; "
     "leave it None"),
    ("flash_decode", bool, "decodes with flash-attn's kernel, bypassing the core attention; mcp_context serves "
                           "training and full-sequence forward passes; set flash_decode=False"),
    ("batch_invariant_mode", bool, "asks for batch-invariant kernels; mcp_context's kernels and merge have not "
                                   "been checked for batch invariance; set batch_invariant_mode=False"),
    ("use_kitchen", bool, "builds kitchen's quantised modules, which mcp_context's specs do not; set "
                          "use_kitchen=False"),
    ("use_kitchen_attention", bool, "replaces the core attention with kitchen's; set use_kitchen_attention=False"),
    ("enable_cuda_graph", bool, f"{_CUDA_GRAPH}; set enable_cuda_graph=False"),
    ("external_cuda_graph", bool, f"{_CUDA_GRAPH}; set external_cuda_graph=False"),
    ("cuda_graph_impl", lambda v: v != "none", f"{_CUDA_GRAPH}; set cuda_graph_impl='none'"),
)


def check_attention_fields(config: Any, prefix: str = "") -> None:
    """Refuse, naming the field, the value and the fix, every attention field we cannot honour."""
    for field, refused, why in REFUSED_FIELDS:
        value = getattr(config, field, None)
        if value is not None and refused(value):
            raise HCPConfigError(f"{prefix}{field}={value!r}: {why}")
    if config.softmax_type not in SOFTMAX_TYPES:
        raise HCPConfigError(f"{prefix}softmax_type={config.softmax_type!r} is not one of "
                             f"{', '.join(SOFTMAX_TYPES)}; choose one of them")
    kernel_backend(config, prefix)


def kernel_backend(config: Any, prefix: str = "") -> str:
    """Our kernel registry's backend for ``attention_backend`` (an ``AttnBackend`` or its name)."""
    backend = config.attention_backend
    name = getattr(backend, "name", backend)
    if name not in ATTENTION_BACKENDS:
        raise HCPConfigError(f"{prefix}attention_backend={backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]


def check_deterministic(config: Any, backend: str, device: Any) -> None:
    """``deterministic_mode`` on CUDA needs kernels whose backward has a fixed accumulation order."""
    if config.deterministic_mode and getattr(device, "type", device) == "cuda" \
            and backend not in DETERMINISTIC_CUDA_BACKENDS:
        raise HCPConfigError(
            f"deterministic_mode=True with attention_backend={config.attention_backend!r} (kernel backend "
            f"{backend!r}) on CUDA: the fused SDPA backwards (flash, cuDNN, efficient) are not guaranteed to "
            f"accumulate gradients in a fixed order (efficient and flash use atomics) and none was checked on a GPU "
            f"here; set attention_backend='unfused' (our math kernel: matmuls, a fixed "
            f"ring and merge order), or deterministic_mode=False")
