"""One transformer layer of the model (our spec) at this CP against the same layer at CP = 1.

megatron-core's ``TransformerLayer`` built from ``get_gpt_layer_hcp_spec(**layer_spec_kwargs(model))``
(the recipe's structure: dense or MoE MLP, q/k norms, MLA; local modules) with the recipe's
``TransformerConfig`` (TP = PP = 1, fp32) twice from one set of weights: once over the CP ranks (its
``pg_collection`` holds the CP group, one group per hierarchy level as ``parallel_state`` would build
them, and one-rank expert groups: every expert on every rank) and once over a one-rank group on the
full sequence. Each rank feeds its zigzag slice of the same hidden states (per document when packed)
with RoPE from megatron-core's ``RotaryEmbedding`` (which slices the table for the CP rank itself; MLA
applies its own), and the output gradient's slice. Compared: the
outputs, gathered and put back in order, and every parameter gradient summed over the CP ranks
(what DDP's all-reduce over DP x CP does) against the CP = 1 layer's, within ``1e-5 * max(1, max|ref|)``
(fp32: accumulation order only). No ``parallel_state`` is touched.

One layer per attention kind: a windowed layer and a full one when ``window_attn_skip_freq`` mixes them.
From attention flags alone a dense layer of their heads is built; MLA head dims from flags have no
layer to build (``checks.unchecked_layer``): a row that did not run, accepted by ``--allow-unchecked``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from ..comm import HCPGroups
from ..comm.groups import level_members
from ..layouts import shard_sequence, unshard_sequence
from .faults import sliced_layout
from .setup import AttentionKind, Setup

LAYER_TOL = 1e-5


def level_groups(sizes: tuple[int, ...], cp_rank: int) -> list:
    """This rank's group at each hierarchy level (every rank creates every group, in one order)."""
    mine = []
    for level in range(len(sizes)):
        members_of = sorted({tuple(level_members(list(sizes), level, r)) for r in range(dist.get_world_size())})
        for members in members_of:
            group = dist.new_group(list(members))
            if cp_rank in members:
                mine.append(group)
    return mine


def model_config(setup: Setup, recipe_model, kind: AttentionKind):
    """The recipe's model (or one built from the attention flags) at TP = PP = 1 in fp32, at this CP."""
    from ..recipes.schema import ModelConfig

    if recipe_model is None:
        hidden = setup.heads * setup.head_dim
        recipe_model = ModelConfig(num_layers=2, hidden_size=hidden, ffn_hidden_size=2 * hidden,
                                   num_attention_heads=setup.heads, num_query_groups=setup.kv_heads,
                                   kv_channels=setup.head_dim, window_size=None if kind.window is None
                                   else list(kind.window))
    m = dataclasses.replace(recipe_model, context_parallel_size=setup.cp_size, window_attn_skip_freq=None,
                            window_size=None if kind.window is None else list(kind.window),
                            hybrid_context_parallel=False, max_seqlen_per_dp_cp_rank=None)
    return fp32_config(m, setup, softmax_type=kind.softmax_type)


def fp32_config(recipe_model, setup: Setup, **fields):
    """``(model, TransformerConfig)``: ``recipe_model`` at TP = PP = 1 in fp32 on CPU-built weights, without
    dropout or recomputation, with the setup's hierarchy and comm (``fields`` over the config's): the model
    the layer and dynamic checks build (the CP size, window and dynamic CP are the caller's)."""
    from ..recipes.schema import transformer_config_class, transformer_config_kwargs

    m = dataclasses.replace(recipe_model, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                            virtual_pipeline_model_parallel_size=None, sequence_parallel=False, bf16=False,
                            params_dtype="float32",
                            hierarchical_context_parallel_sizes=list(setup.sizes) if len(setup.sizes) > 1 else None,
                            cp_comm_type=setup.comm, attention_dropout=0.0, hidden_dropout=0.0,
                            recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    kwargs = transformer_config_kwargs(m)  # the one translation (tests/test_recipes.py checks every builder)
    kwargs.update(fields)
    return m, transformer_config_class(m)(**kwargs, use_cpu_initialization=True, masked_softmax_fusion=False,
                                          bias_activation_fusion=False, apply_rope_fusion=False,
                                          bias_dropout_fusion=False, gradient_accumulation_fusion=False)


def layer_parity(setup: Setup, kind: AttentionKind, groups: HCPGroups, recipe_model=None,
                 fault: Optional[str] = None) -> dict:
    """Run both layers: ``{"forward": (error, bound), "<param>": (error, bound), ...}`` (``fault``
    'layout-mismatch': the hidden states are sliced in another layout than Megatron's zigzag)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    import megatron_patches
    from ..megatron.specs import get_gpt_layer_hcp_spec
    from ..recipes.schema import layer_spec_kwargs

    device = torch.device(setup.device)
    megatron_patches.apply_all(device=device)
    rank, cp = groups.cp_rank, groups.cp_size
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    alone = singles[dist.get_rank()]
    hcp = level_groups(setup.sizes, rank) if len(setup.sizes) > 1 else None
    m, config = model_config(setup, recipe_model, kind)
    one = dataclasses.replace(config, context_parallel_size=1, hierarchical_context_parallel_sizes=None,
                              cp_comm_type="p2p")
    spec = get_gpt_layer_hcp_spec(**{**layer_spec_kwargs(m), "use_te": False})
    torch.manual_seed(setup.seed)
    experts = dict(ep=alone, expt_tp=alone, tp_ep=alone, expt_dp=alone)  # one rank: every expert here
    reference = build_module(spec, config=one, layer_number=1, pg_collection=ProcessGroupCollection(
        tp=alone, pp=alone, dp=alone, cp=alone, tp_cp=alone, dp_cp=alone, tp_dp_cp=alone, **experts)).to(device)
    cp_group = groups.cp_group  # TP = DP = 1: every group that spans CP is the CP group
    layer = build_module(spec, config=config, layer_number=1, pg_collection=ProcessGroupCollection(
        tp=alone, pp=alone, dp=alone, cp=cp_group, tp_cp=cp_group, dp_cp=cp_group, tp_dp_cp=cp_group, **experts,
        **({"hcp": hcp} if hcp else {}))).to(device)
    layer.load_state_dict(reference.state_dict())

    gen = torch.Generator().manual_seed(setup.seed + 11)
    batch = 1 if kind.packed else setup.batch
    x = torch.randn(setup.seq_len, batch, config.hidden_size, generator=gen)
    dy = torch.randn(setup.seq_len, batch, config.hidden_size, generator=gen)
    cu, padded, params_full, params_cp = None, None, None, None
    rope = RotaryEmbedding(config.kv_channels, m.rotary_percent, rotary_base=m.rotary_base,
                           rope_scaling=m.rope_scaling, rope_scaling_factor=m.rope_scaling_factor,
                           use_cpu_initialization=True).to(device)
    if kind.packed:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu, padded = (torch.tensor(list(x), dtype=torch.int32) for x in setup.documents)
        longest = int(padded.diff().max())
        params_cp = params_full = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu.to(device), cu_seqlens_kv=cu.to(device),
            cu_seqlens_q_padded=padded.to(device), cu_seqlens_kv_padded=padded.to(device),
            max_seqlen_q=longest, max_seqlen_kv=longest)
        emb_full = emb_cp = rope(longest, packed_seq=True)
    else:
        emb_full, emb_cp = rope(setup.seq_len, cp_group=alone), rope(setup.seq_len, cp_group=groups.cp_group)
    if getattr(m, "multi_latent_attention", False):  # MLA applies its own RoPE (sliced for the CP rank itself)
        emb_full = emb_cp = None

    x_full = x.to(device).requires_grad_()
    y_full, _ = reference(x_full, attention_mask=None, rotary_pos_emb=emb_full, packed_seq_params=params_full)
    y_full.backward(dy.to(device))
    sliced = sliced_layout("zigzag", kind.packed, fault)
    x_local = shard_sequence(x, cp, rank, sliced, 0, cu, padded).to(device).requires_grad_()
    y_local, _ = layer(x_local, attention_mask=None, rotary_pos_emb=emb_cp, packed_seq_params=params_cp)
    y_local.backward(shard_sequence(dy, cp, rank, sliced, 0, cu, padded).to(device))

    parts = [torch.empty_like(y_local) for _ in range(cp)]
    dist.all_gather(parts, y_local.detach().contiguous(), group=groups.cp_group)
    y_gathered = unshard_sequence([p.cpu() for p in parts], "zigzag", 0, cu, padded)
    figures = {"forward": error_and_bound(y_gathered, y_full.detach().cpu())}
    for (name, param), (_, ref_param) in zip(layer.named_parameters(), reference.named_parameters()):
        grad = param.grad.detach().clone()
        dist.all_reduce(grad, group=groups.cp_group)
        figures[name] = error_and_bound(grad.cpu(), ref_param.grad.detach().cpu())
    return figures


def error_and_bound(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Max abs error of ``got`` against the CP = 1 ``ref``, and its bound ``LAYER_TOL * max(1, max|ref|)``."""
    return float((got.double() - ref.double()).abs().max()), LAYER_TOL * max(1.0, float(ref.abs().max()))
