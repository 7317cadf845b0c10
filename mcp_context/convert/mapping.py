"""Tensor-by-tensor mapping between Hugging Face Llama-family weights and Megatron-Core keys.

Owns the name table (HF name <-> Megatron-Core dist-checkpoint key <-> local-spec and TE-spec
parameter names), the fusing rules and their inverses:

* ``linear_qkv`` is grouped per query group: for each of the ``g`` KV heads, the
  ``h / g`` query heads that share it, then its key head, then its value head
  (``[g, (h/g + 2) * d, hidden]``). Tensor parallelism splits this tensor along dim 0 into
  contiguous blocks of whole query groups, so the global tensor is the same at every TP size.
* ``linear_fc1`` is ``[gate; up]`` (megatron-core stores the SwiGLU halves as two sharded
  tensors under one key, so the global tensor is again independent of TP).

It does not read or write files (``hf_io``, ``mcore_io``) and knows nothing about configs beyond
the model shape (:class:`~mcp_context.recipes.schema.ModelConfig`) of a converted model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mcp_context.recipes.schema import ModelConfig

LAYER_KEY_PREFIX = "decoder.layers."
# Modules whose ``_extra_state`` megatron-core's loader requests per layer: the four linears of the
# local spec, plus TE's core attention (harmless extra entries for the local spec).
EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                       "mlp.linear_fc2", "self_attention.core_attention")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """``q: [h*d, ...]``, ``k, v: [g*d, ...]`` -> ``linear_qkv`` ``[(h + 2g) * d, ...]`` grouped per query group."""
    rest = q.shape[1:]
    q_g = q.reshape(num_query_groups, -1, *rest)
    k_g = k.reshape(num_query_groups, -1, *rest)
    v_g = v.reshape(num_query_groups, -1, *rest)
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: ``[(h + 2g) * d, ...]`` -> ``(q [h*d, ...], k [g*d, ...], v [g*d, ...])``."""
    rest = qkv.shape[1:]
    q_per_group = num_attention_heads // num_query_groups * head_dim
    grouped = qkv.reshape(num_query_groups, q_per_group + 2 * head_dim, *rest)
    q, k, v = torch.split(grouped, [q_per_group, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate, up: [ffn, hidden]`` -> ``linear_fc1`` ``[2 * ffn, hidden]`` (``[gate; up]``)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_gate_up`."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def _identity(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _unwrap(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor]


@dataclass(frozen=True)
class TensorMap:
    """One Megatron-Core tensor and the Hugging Face tensors it is made of.

    ``mcore_key`` is the dist-checkpoint key (TE naming, which the local spec maps to through its
    ``sharded_state_dict_keys_map``); per-layer tensors are stacked there along a leading layer axis.
    ``hf_names``, ``local_name`` and ``te_name`` hold ``{layer}`` where ``per_layer`` is true.
    """

    mcore_key: str
    local_name: str
    te_name: str
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    per_layer: bool
    fuse: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    split: Callable[[torch.Tensor], Sequence[torch.Tensor]]

    @property
    def mcore_shape(self) -> tuple[int, ...]:
        """Shape of one layer's (or the only) Megatron tensor."""
        first = self.hf_shapes[0]
        return (sum(s[0] for s in self.hf_shapes), *first[1:])

    def hf_names_for(self, layer: int | None) -> list[str]:
        return [n.format(layer=layer) for n in self.hf_names]

    def param_name(self, layer: int | None, spec: str) -> str:
        """Parameter name in a Megatron-Core model built with the ``"local"`` or ``"te"`` layer spec."""
        if spec not in ("local", "te"):
            raise ValueError(f"spec={spec!r} is not a layer-spec flavour; use 'local' or 'te'")
        name = self.local_name if spec == "local" else self.te_name
        return name.format(layer=layer)


def tensor_maps(model: ModelConfig) -> list[TensorMap]:
    """The full table for ``model``, in checkpoint order (embedding, layers, final norm, output)."""
    h, g, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    hidden, ffn, vocab = model.hidden_size, model.ffn_hidden_size, model.vocab_size

    def qkv_split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return split_qkv(t, h, g, d)

    def qkv_fuse(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        return fuse_qkv(ts[0], ts[1], ts[2], g)

    def fc1_fuse(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        return fuse_gate_up(ts[0], ts[1])

    hf_layer = "model.layers.{layer}."
    mc_layer = "decoder.layers.{layer}."
    maps = [TensorMap("embedding.word_embeddings.weight", "embedding.word_embeddings.weight",
                      "embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                      ((vocab, hidden),), False, _identity, _unwrap)]

    def layer(suffix_local: str, suffix_te: str, hf: tuple[str, ...], shapes: tuple[tuple[int, ...], ...],
              fuse: Callable = _identity, split: Callable = _unwrap) -> TensorMap:
        return TensorMap(LAYER_KEY_PREFIX + suffix_te, mc_layer + suffix_local, mc_layer + suffix_te,
                         tuple(hf_layer + n for n in hf), shapes, True, fuse, split)

    maps += [
        layer("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight",
              ("input_layernorm.weight",), ((hidden,),)),
        layer("self_attention.linear_qkv.weight", "self_attention.linear_qkv.weight",
              ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
              ((h * d, hidden), (g * d, hidden), (g * d, hidden)), qkv_fuse, qkv_split),
    ]
    if model.add_qkv_bias:
        maps.append(layer("self_attention.linear_qkv.bias", "self_attention.linear_qkv.bias",
                          ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                          ((h * d,), (g * d,), (g * d,)), qkv_fuse, qkv_split))
    maps += [
        layer("self_attention.linear_proj.weight", "self_attention.linear_proj.weight",
              ("self_attn.o_proj.weight",), ((hidden, h * d),)),
        layer("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight",
              ("post_attention_layernorm.weight",), ((hidden,),)),
        layer("mlp.linear_fc1.weight", "mlp.linear_fc1.weight",
              ("mlp.gate_proj.weight", "mlp.up_proj.weight"), ((ffn, hidden), (ffn, hidden)),
              fc1_fuse, split_gate_up),
        layer("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", ("mlp.down_proj.weight",), ((hidden, ffn),)),
        TensorMap("decoder.final_layernorm.weight", "decoder.final_layernorm.weight",
                  "decoder.final_layernorm.weight", ("model.norm.weight",), ((hidden,),), False,
                  _identity, _unwrap),
    ]
    if not model.share_embeddings_and_output_weights:
        maps.append(TensorMap("output_layer.weight", "output_layer.weight", "output_layer.weight",
                              ("lm_head.weight",), ((vocab, hidden),), False, _identity, _unwrap))
    return maps


def layer_indices(tmap: TensorMap, model: ModelConfig) -> list[int | None]:
    """The layers a map covers: ``0..num_layers-1`` for per-layer tensors, ``[None]`` otherwise."""
    return list(range(model.num_layers)) if tmap.per_layer else [None]


def hf_tensors(model: ModelConfig) -> list[tuple[str, tuple[int, ...], TensorMap]]:
    """Every Hugging Face tensor of ``model`` as ``(name, shape, its TensorMap)``, in mapping order."""
    return [(name, shape, tmap) for tmap in tensor_maps(model) for layer in layer_indices(tmap, model)
            for name, shape in zip(tmap.hf_names_for(layer), tmap.hf_shapes)]
