"""``HCPDotProductAttention``: megatron-core's core-attention slot filled by our engine.

Same constructor and forward as megatron-core's ``DotProductAttention``, so a layer spec swaps it in
with no other change. It reads ``context_parallel_size``, ``hierarchical_context_parallel_sizes`` and
``cp_comm_type`` from the ``TransformerConfig``, the groups from ``pg_collection`` (newer cores) or
``model_comm_pgs`` (older cores) or ``parallel_state``, and runs ``context_parallel_attention`` on the
zigzag layout that megatron-core's batch and RoPE slicing use, through one engine per mask and
train/eval mode, shared by every layer with the same attention (``engine_for``), that resolves
schedule, peers and kernel on the first call and is reused after.
Sliding-window layers (``window_size``, with ``window_attn_skip_freq`` choosing which layers have
it) run the window through every comm type: query ``i`` sees keys ``i - left .. i + right``, with
``right`` capped at 0 for a causal layer.

``softmax_type`` 'off-by-one' and 'learnable' (gpt-oss's sinks) give the engine a per-head
``softmax_offset`` made as megatron-core makes it; MLA's ``k_channels``/``v_channels`` (value head dim
different from the query/key one) are taken as ``TEDotProductAttention`` takes them. Every other
attention field of the config is honoured or refused at build (``config.check_attention_fields``;
``attention_backend`` picks our kernel backend), and a spec from ``get_gpt_layer_hcp_spec`` carries
the layer structure it builds, so a config it does not represent is refused (``spec_facts``).

With ``attn_mask_type=causal`` the ``attention_mask`` argument is ignored, as in
``TEDotProductAttention``: the mask is implied by the positions each CP rank holds. Packed sequences
(``packed_seq_params`` with ``qkv_format="thd"``: ``q [t, np, hn]``, global ``cu_seqlens_q`` and
``cu_seqlens_q_padded``) run with a document mask on megatron-core's per-document zigzag (what its thd
RoPE and ``slice_batch_for_cp`` assume); the first layer of a step parses the offsets, has the CP ranks
agree on them and keeps the ``Documents`` value on the ``PackedSeqParams`` for the other layers. Under
``hybrid_context_parallel`` (dynamic CP, docs/dynamic_cp.md) a sub-sample's ``PackedSeqParams(local_cp_size,
cp_group)`` picks the group and hierarchy the engine runs over (``dynamic_groups``), one engine per group;
without it, a ``PackedSeqParams`` naming any group but the CP group is refused. Arbitrary masks, attention bias, other packed formats and
keys packed differently from queries are refused with a clear error.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from ..api import engine_for
from ..cp_rules import heads_per_tp_rank, normalize_comm
from ..engine import ContextParallelAttention, agree_on_documents
from ..masks import SlidingWindow, documents_mask
from ..comm import HCPGroups
from .config import (HCPConfigError, check_attention_fields, check_deterministic, kernel_backend,
                     normalize_cp_comm_type, validate_cp_config)
from .dynamic_groups import SubSampleGroups
from .spec_facts import LayerSpecFacts, check_spec_fits

LAYOUT = "zigzag"  # megatron-core's get_batch_on_this_cp_rank and RoPE slicing assume it


def _hcp_groups(pg_collection: Any) -> HCPGroups:
    cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if cp is None:
        return HCPGroups.from_megatron()
    levels = getattr(pg_collection, "hcp", None)
    if not levels:
        return HCPGroups.flat(cp)
    return HCPGroups(cp, levels[0], tuple(torch.distributed.get_world_size(g) for g in levels))


def _packed_documents(params: Any, groups: HCPGroups) -> dict:
    """The engine's ``documents`` from megatron-core's ``PackedSeqParams`` (empty without one), parsed,
    checked and agreed by the CP ranks once per step: the first layer to see ``params`` keeps the value on
    it, and every later layer reuses it (no parse, no host synchronisation per layer). Other formats and
    keys packed differently from queries are refused naming the fix."""
    if params is None:
        return {}
    kept = getattr(params, "_hcp_documents", None)
    if kept is not None and kept.agreed_in is groups.cp_group:
        return {"documents": kept}
    fmt = getattr(params, "qkv_format", None)
    if fmt != "thd":
        raise NotImplementedError(f"HCPDotProductAttention does not support packed sequences with "
                                  f"packed_seq_params.qkv_format={fmt!r}; pass megatron-core's PackedSeqParams with "
                                  f"qkv_format='thd', or no packed_seq_params")
    for q_name, kv_name in (("cu_seqlens_q", "cu_seqlens_kv"), ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
        q, kv = getattr(params, q_name), getattr(params, kv_name)
        if kv is not None and (q is None or not torch.equal(q.cpu(), kv.cpu())):
            raise NotImplementedError(f"packed_seq_params.{kv_name} differs from {q_name}: HCPDotProductAttention "
                                      f"runs self-attention over one packing; pass the same offsets for both")
    if params.cu_seqlens_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is None; set it to the documents' cumulative lengths "
                         "(int32 [n_docs + 1])")
    documents = agree_on_documents(documents_mask(params.cu_seqlens_q, params.cu_seqlens_q_padded), groups)
    params._hcp_documents = documents  # this step's packing, for the layers after this one
    return {"documents": documents}


def _sub_sample_groups(config: Any, pg_collection: Any, comm: str, single: HCPGroups) -> SubSampleGroups:
    """Dynamic CP (``hybrid_context_parallel``): the resolver of each sub-sample's groups over the data x
    context parallel group, whose size the hierarchy must multiply to."""
    world = getattr(pg_collection, "dp_cp", None) if pg_collection is not None else None
    if world is None:
        from megatron.core import parallel_state

        world = parallel_state.get_data_parallel_group(with_context_parallel=True)
    sizes, n = config.hierarchical_context_parallel_sizes, _size(world)
    if sizes and math.prod(sizes) != n:
        raise HCPConfigError(f"hierarchical_context_parallel_sizes={list(sizes)} multiply to {math.prod(sizes)}, but "
                             f"with hybrid_context_parallel=True they describe the {n} data x context parallel ranks; "
                             f"choose sizes whose product is {n} (level 0: the ranks of one all-to-all domain)")
    return SubSampleGroups(world, sizes[0] if sizes else None, normalize_comm(comm or "p2p"), single)


def _is_sub_sample(params: Any) -> bool:
    """Whether ``params`` names a dynamic-CP sub-sample's own group (megatron-core's hybrid CP)."""
    return params is not None and (getattr(params, "local_cp_size", None) is not None
                                   or getattr(params, "cp_group", None) is not None)


def _tp_group(pg_collection: Any) -> Any:
    tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    if tp is None:
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    return tp


def _size(group: Any) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


class HCPDotProductAttention(MegatronModule):
    """Exact hierarchical context-parallel attention:
    ``q [s, b, np, dk], k [s, b, ng, dk], v [s, b, ng, dv] -> [s, b, np*dv]`` (``dv = dk`` except for MLA)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Any = None, model_comm_pgs: Any = None,
                 layer_spec: Optional[LayerSpecFacts] = None, step_graphs: bool = False):
        super().__init__(config=config)
        self.step_graphs = step_graphs  # the spec's choice (get_gpt_layer_hcp_spec): checked by the engine
        normalize_cp_comm_type(config)
        validate_cp_config(config)
        check_attention_fields(config)
        if layer_spec is not None:  # the spec this layer was built from: does it represent the config?
            check_spec_fits(config, layer_spec)
        self.layer_number = max(1, layer_number)
        # Sliding-window layers (every layer, or those window_attn_skip_freq picks) get the window;
        # the others attend in full, as megatron-core's own attention does.
        self.window_size = (tuple(config.window_size) if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, self.layer_number) else None)
        if self.window_size is not None:
            try:
                SlidingWindow(*self.window_size)
            except (TypeError, ValueError) as err:
                raise HCPConfigError(f"TransformerConfig.{err}") from None
        self.attn_mask_type = attn_mask_type
        comm = cp_comm_type if cp_comm_type is not None else config.cp_comm_type
        if isinstance(comm, (list, tuple)):  # a per-layer list reaching us unindexed
            comm = comm[self.layer_number - 1]
        # CP=1 needs no communication, whatever was configured.
        self.cp_comm_type = "p2p" if config.context_parallel_size == 1 else normalize_comm(comm or "p2p")
        # MLA passes its query/key head dim (k_channels) and value head dim (v_channels), as to TE's attention.
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        # apply_query_key_layer_scaling: megatron-core divides the scale by the layer number and its softmax
        # multiplies the scores back by the same number (an fp16 range trick): no change to the maths.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.backend = kernel_backend(config)
        self.pg_collection = pg_collection if pg_collection is not None else model_comm_pgs
        self.groups = _hcp_groups(self.pg_collection)
        self._engines: dict[tuple, ContextParallelAttention] = {}  # per (causal, dropout, groups, comm)
        if self.groups.cp_size != config.context_parallel_size:
            raise HCPConfigError(f"TransformerConfig.context_parallel_size={config.context_parallel_size}, but the "
                                 f"context-parallel process group has {self.groups.cp_size} ranks; initialise "
                                 f"parallel_state with context_parallel_size={config.context_parallel_size} (and "
                                 f"the same hierarchical_context_parallel_sizes) before building the model")
        # hybrid_context_parallel: each sub-sample runs over the group its PackedSeqParams name
        self.sub_sample_groups = (_sub_sample_groups(config, self.pg_collection, comm, self.groups)
                                  if getattr(config, "hybrid_context_parallel", False) else None)
        self.tp_group = _tp_group(self.pg_collection)
        self.num_attention_heads_per_partition = config.num_attention_heads // _size(self.tp_group)
        if self.sub_sample_groups is not None:
            try:
                self.sub_sample_groups.check_heads(*heads_per_tp_rank(
                    config.num_attention_heads, config.num_query_groups or config.num_attention_heads,
                    _size(self.tp_group)))
            except ValueError as err:
                raise HCPConfigError(f"hybrid_context_parallel with cp_comm_type={comm!r}: {err}") from None
        self._init_softmax_offset(config)

    def _init_softmax_offset(self, config) -> None:
        """``softmax_offset`` as megatron-core's ``DotProductAttention`` makes it (name, shape, dtype, init), so
        stock checkpoints load: None ('vanilla'), zeros that are not a parameter ('off-by-one'), or a parameter
        of one sink logit per head of this TP partition ('learnable'). Placed on the CPU when the model is
        initialised there (megatron-core always uses ``torch.cuda.current_device()``)."""
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() \
            else torch.cuda.current_device()
        shape, dtype = (self.num_attention_heads_per_partition,), config.params_dtype
        if config.softmax_type == "vanilla":
            self.softmax_offset = None
        elif config.softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(shape, device=device, dtype=dtype)
        else:  # learnable (check_attention_fields refused anything else)
            self.register_parameter("softmax_offset", torch.nn.Parameter(torch.empty(shape, device=device,
                                                                                     dtype=dtype)))
            if config.perform_initialization:
                self.softmax_offset = config.init_method(self.softmax_offset)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
        groups, comm = self.groups, self.cp_comm_type
        if self.sub_sample_groups is not None and _is_sub_sample(packed_seq_params):
            groups, comm = self._sub_sample(packed_seq_params, query)
            packed = {}
        else:
            self._check_fixed_group(packed_seq_params)
            packed = _packed_documents(packed_seq_params, self.groups)
        if attention_bias is not None:
            raise NotImplementedError("HCPDotProductAttention does not support attention_bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type == AttnMaskType.causal or (packed and mask_type == AttnMaskType.padding_causal):
            causal = True
        elif mask_type == AttnMaskType.no_mask or (mask_type == AttnMaskType.padding and attention_mask is None):
            causal = False
        else:
            raise NotImplementedError(f"attn_mask_type={mask_type.name} with an explicit attention_mask is not "
                                      f"supported by HCPDotProductAttention; use causal or no_mask")
        dropout = self.training and self.dropout_p > 0
        if packed:  # thd: [t, np, hn], the batch dimension squeezed out by megatron-core
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        offset = self.softmax_offset
        if offset is not None and offset.device != query.device and not isinstance(offset, torch.nn.Parameter):
            self.softmax_offset = offset = offset.to(query.device)  # off-by-one's zeros follow the activations
        out = self._engine(causal, dropout, query.device, groups, comm)(
            query, key, value, dropout_seed=self._dropout_seed(query.device) if dropout else None,
            softmax_offset=offset, **packed)
        s, b, h, d = out.shape
        return out.reshape(s, h * d) if packed else out.reshape(s, b, h * d)

    def _sub_sample(self, params: Any, query: torch.Tensor) -> tuple[HCPGroups, str]:
        """The groups and comm of a dynamic-CP sub-sample (one sequence, ``sbhd``, sharded zigzag over its
        ``cp_group`` by megatron-core's ``get_batch_on_this_hybrid_cp_rank``)."""
        fmt = getattr(params, "qkv_format", None)
        if fmt not in (None, "sbhd"):
            raise NotImplementedError(f"packed_seq_params.qkv_format={fmt!r} with a per-sub-sample cp_group: a dynamic-CP "
                                      f"sub-sample is one sequence in sbhd (megatron-core's hybrid CP makes it so); "
                                      f"packed documents inside a sub-sample are not supported")
        return self.sub_sample_groups.resolve(params, query.shape[0])

    def _check_fixed_group(self, params: Any) -> None:
        """Without hybrid CP, ``packed_seq_params`` may name the fixed CP group (megatron-core's thd batches do),
        not another one, and carries no ``local_cp_size``."""
        if params is None:
            return
        n, group = getattr(params, "local_cp_size", None), getattr(params, "cp_group", None)
        other = group is not None and group is not self.groups.cp_group and (
            torch.distributed.get_process_group_ranks(group) != self.groups.cp_global_ranks)
        if n is not None or other:
            raise HCPConfigError(f"packed_seq_params carries local_cp_size={n} / a cp_group of ranks "
                                 f"{torch.distributed.get_process_group_ranks(group) if group is not None else None} "
                                 f"other than the CP group {self.groups.cp_global_ranks}, but "
                                 f"TransformerConfig.hybrid_context_parallel=False; set hybrid_context_parallel=True "
                                 f"(with max_seqlen_per_dp_cp_rank) to run each sub-sample over its own group")

    def _engine(self, causal: bool, dropout: bool, device: torch.device, groups: HCPGroups,
                comm: str) -> ContextParallelAttention:
        """The engine for this mask, train/eval mode and group: the one every layer with the same attention
        shares (``engine_for``), looked up on first use and kept for the layer's life (under dynamic CP one
        per sub-sample group)."""
        key = (causal, dropout, groups, comm)
        if key not in self._engines:
            check_deterministic(self.config, self.backend, device)
            self._engines[key] = engine_for(
                groups, causal=causal, layout=LAYOUT, comm=comm, softmax_scale=self.softmax_scale,
                backend=self.backend, dropout_p=self.dropout_p if dropout else 0.0, window_size=self.window_size,
                step_graphs=self.step_graphs)
        return self._engines[key]

    @staticmethod
    def _dropout_seed(device: torch.device) -> int:
        """A fresh seed per call from megatron's model-parallel RNG stream (the one its dropout uses), so
        runs are reproducible from the training seed and activation recomputation replays the masks."""
        from megatron.core import tensor_parallel

        with tensor_parallel.get_cuda_rng_tracker().fork():
            return int(torch.randint(0, 2**62, (1,), device=device).item())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The learnable ``softmax_offset`` sharded over TP along its head dim, as megatron-core saves it."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True) if self.config.softmax_type == "learnable" else {}
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
