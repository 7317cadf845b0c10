"""Tensor-by-tensor mapping between Hugging Face decoder weights and Megatron-Core keys.

Owns the name table (HF name <-> Megatron-Core dist-checkpoint key <-> local-spec and TE-spec
parameter names), the fusing rules and their inverses:

* ``linear_qkv`` is grouped per query group: for each of the ``g`` KV heads, the
  ``h / g`` query heads that share it, then its key head, then its value head
  (``[g, (h/g + 2) * d, hidden]``). Tensor parallelism splits this tensor along dim 0 into
  contiguous blocks of whole query groups, so the global tensor is the same at every TP size.
* ``linear_fc1`` is ``[gate; up]`` (megatron-core stores the SwiGLU halves as two sharded
  tensors under one key, so the global tensor is again independent of TP); an expert's too.
* q/k norms (Qwen3's per-head ``q_norm`` / ``k_norm``) are megatron-core's ``q_layernorm`` /
  ``k_layernorm``; a MoE layer's router is ``mlp.router``, its experts megatron-core's local
  (sequential) experts, stored with a leading expert axis after the layer axis.

It does not read or write files (``hf_io``, ``mcore_io``) and knows nothing about configs beyond
the model shape (:class:`~mcp_context.recipes.schema.ModelConfig`) of a converted model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from mcp_context.recipes.schema import ModelConfig

LAYER_KEY_PREFIX = "decoder.layers."
# Modules whose ``_extra_state`` megatron-core's loader requests per layer: the four linears of the
# local spec, plus TE's core attention (harmless extra entries for the local spec).
ATTENTION_EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv",
                                 "self_attention.core_attention")
MLA_EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_q_down_proj",
                           "self_attention.linear_q_up_proj", "self_attention.linear_kv_down_proj",
                           "self_attention.linear_kv_up_proj", "self_attention.core_attention")
SHARED_EXPERT_EXTRA_STATE_MODULES = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
DENSE_MLP_EXTRA_STATE_MODULES = ("mlp.linear_fc1", "mlp.linear_fc2")
# A MoE layer's local experts: one object per (layer, expert) under these keys.
EXPERT_EXTRA_STATE_MODULES = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
# The Hugging Face names of a MoE layer, per model type: (router, expert prefix, gate, up, down).
HF_MOE_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{expert}.", "w1.weight", "w3.weight",
                "w2.weight"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{expert}.", "gate_proj.weight", "up_proj.weight",
                  "down_proj.weight"),
    "deepseek_v3": ("mlp.gate.weight", "mlp.experts.{expert}.", "gate_proj.weight", "up_proj.weight",
                    "down_proj.weight"),
}
# gpt-oss holds a layer's experts in one tensor each, transposed, gate and up interleaved on the last axis.
GPT_OSS_EXPERTS = "mlp.experts."


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
    ``hf_names``, ``local_name`` and ``te_name`` hold ``{layer}`` where ``per_layer`` is true, and
    ``{expert}`` where ``experts`` (the expert count of a local-experts tensor) is non-zero and the
    Hugging Face side has one tensor per expert; such a tensor is stored as ``[num_layers, experts, ...]``.
    Where the Hugging Face side holds all experts of a layer in one tensor (gpt-oss), the names have no
    ``{expert}``, one chunk is a whole layer's ``[experts, ...]`` and ``expert_shape`` gives one expert's
    Megatron shape. ``layers`` names the layers a per-layer tensor exists on (None: all); in a model whose
    other layers are dense, every per-layer tensor is one ``TensorMap`` per layer (``layer``).
    """

    mcore_key: str
    local_name: str
    te_name: str
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    per_layer: bool
    fuse: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    split: Callable[[torch.Tensor], Sequence[torch.Tensor]]
    layers: Optional[tuple[int, ...]] = None
    experts: int = 0
    expert_shape: Optional[tuple[int, ...]] = None
    layer: Optional[int] = None
    """A block with dense layers among MoE ones stores each layer under its own key (``decoder.layers.N.…``,
    no layer axis; megatron-core's ``non_homogeneous_layers``): the one layer this tensor is, else None."""

    @property
    def mcore_shape(self) -> tuple[int, ...]:
        """Shape of one layer's (or one expert's, or the only) Megatron tensor."""
        if self.expert_shape is not None:
            return self.expert_shape
        first = self.hf_shapes[0]
        return (sum(s[0] for s in self.hf_shapes), *first[1:])

    def hf_names_for(self, layer: int | None, expert: int | None = None) -> list[str]:
        layer = self.layer if self.layer is not None else layer
        return [n.format(layer=layer, expert=expert) for n in self.hf_names]

    def param_name(self, layer: int | None, spec: str, expert: int | None = None) -> str:
        """Parameter name in a Megatron-Core model built with the ``"local"`` or ``"te"`` layer spec."""
        if spec not in ("local", "te"):
            raise ValueError(f"spec={spec!r} is not a layer-spec flavour; use 'local' or 'te'")
        name = self.local_name if spec == "local" else self.te_name
        return name.format(layer=self.layer if self.layer is not None else layer, expert=expert)

    def global_shape(self, model: ModelConfig) -> tuple[int, ...]:
        """Shape of the stored Megatron tensor: the leading layer and expert axes, then one chunk's."""
        lead = ((model.num_layers,) if self.per_layer else ()) + ((self.experts,) if self.experts else ())
        return lead + self.mcore_shape


Slot = tuple  # () for a global tensor, (layer,) per layer, (layer, expert) per local expert; (expert,) in one layer's


def slots(tmap: TensorMap, model: ModelConfig) -> list[Slot]:
    """The leading indices of every stored chunk of ``tmap``: ``[()]`` for a global tensor, one
    ``(layer,)`` per layer that has it, or one ``(layer, expert)`` per local expert of those layers; for one
    layer's tensor (``tmap.layer``), ``[()]`` or one ``(expert,)`` per local expert."""
    if tmap.layer is not None:
        return [(expert,) for expert in range(tmap.experts)] if tmap.experts and "{expert}" in tmap.hf_names[0] \
            else [()]
    if not tmap.per_layer:
        return [()]
    layers = tmap.layers if tmap.layers is not None else range(model.num_layers)
    if tmap.experts and "{expert}" in tmap.hf_names[0]:
        return [(layer, expert) for layer in layers for expert in range(tmap.experts)]
    return [(layer,) for layer in layers]


def hf_names_at(tmap: TensorMap, slot: Slot) -> list[str]:
    """The Hugging Face names of ``tmap``'s chunk at ``slot``."""
    if tmap.layer is not None:
        return tmap.hf_names_for(tmap.layer, slot[0] if slot else None)
    return tmap.hf_names_for(slot[0] if slot else None, slot[1] if len(slot) > 1 else None)


def non_homogeneous(model: ModelConfig) -> bool:
    """Whether megatron-core keys ``model``'s layers one by one (dense layers among MoE ones)."""
    return model.num_moe_experts is not None and model.moe_layer_freq != 1


def moe_layers(model: ModelConfig) -> list[int]:
    """The layers whose MLP is a mixture of experts (megatron-core's ``moe_layer_freq`` read as its
    ``get_gpt_decoder_block_spec`` reads it): none for a dense model."""
    if model.num_moe_experts is None:
        return []
    freq = model.moe_layer_freq
    if isinstance(freq, int):
        return [i for i in range(model.num_layers) if i % freq == 0]
    return [i for i, moe in enumerate(freq) if moe]


def tensor_maps(model: ModelConfig, model_type: str = "llama") -> list[TensorMap]:
    """The full table for ``model`` (a ``model_type`` checkpoint), in checkpoint order (embedding,
    layers, final norm, output); with dense layers among MoE ones, one map per layer and tensor, keyed
    ``decoder.layers.N.…`` as megatron-core's ``TransformerBlock.sharded_state_dict`` keys them then."""
    maps = _stacked_maps(model, model_type)
    if not non_homogeneous(model):
        return maps
    per_layer = [m for m in maps if m.per_layer]
    first = maps.index(per_layer[0])
    one_layer = [dataclasses.replace(m, mcore_key=f"{LAYER_KEY_PREFIX}{i}.{m.mcore_key[len(LAYER_KEY_PREFIX):]}",
                                     per_layer=False, layers=None, layer=i)
                 for i in range(model.num_layers) for m in per_layer if m.layers is None or i in m.layers]
    return maps[:first] + one_layer + [m for m in maps[first:] if not m.per_layer]


def _stacked_maps(model: ModelConfig, model_type: str) -> list[TensorMap]:
    """``tensor_maps`` with every per-layer tensor stacked on a leading layer axis (``layers``: where it exists)."""
    h, g, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    hidden, ffn, vocab = model.hidden_size, model.ffn_hidden_size, model.vocab_size
    sparse = moe_layers(model)
    dense = tuple(i for i in range(model.num_layers) if i not in sparse) if sparse else None

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
              fuse: Callable = _identity, split: Callable = _unwrap, layers: Optional[tuple[int, ...]] = None,
              experts: int = 0, key: Optional[str] = None) -> TensorMap:
        return TensorMap(LAYER_KEY_PREFIX + (key or suffix_te), mc_layer + suffix_local, mc_layer + suffix_te,
                         tuple(hf_layer + n for n in hf), shapes, True, fuse, split, layers, experts)

    if model.multi_latent_attention:
        return _mla_maps(model, model_type, maps, layer, fc1_fuse, sparse, dense)
    maps += [
        layer("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight",
              ("input_layernorm.weight",), ((hidden,),)),
        layer("self_attention.linear_qkv.weight", "self_attention.linear_qkv.weight",
              ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
              ((h * d, hidden), (g * d, hidden), (g * d, hidden)), qkv_fuse, qkv_split),
    ]
    if model.add_qkv_bias or model.add_bias_linear:  # megatron-core: either puts a bias on linear_qkv
        maps.append(layer("self_attention.linear_qkv.bias", "self_attention.linear_qkv.bias",
                          ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                          ((h * d,), (g * d,), (g * d,)), qkv_fuse, qkv_split))
    if model.qk_layernorm:
        maps += [layer("self_attention.q_layernorm.weight", "self_attention.q_layernorm.weight",
                       ("self_attn.q_norm.weight",), ((d,),)),
                 layer("self_attention.k_layernorm.weight", "self_attention.k_layernorm.weight",
                       ("self_attn.k_norm.weight",), ((d,),))]
    if model.softmax_type == "learnable":  # gpt-oss's sinks: one logit per head in every softmax's denominator
        offset = "self_attention.core_attention.softmax_offset"
        maps.append(layer(offset, offset, ("self_attn.sinks",), ((h,),)))
    if model.add_bias_linear:
        maps.append(layer("self_attention.linear_proj.bias", "self_attention.linear_proj.bias",
                          ("self_attn.o_proj.bias",), ((hidden,),)))
    maps += [
        layer("self_attention.linear_proj.weight", "self_attention.linear_proj.weight",
              ("self_attn.o_proj.weight",), ((hidden, h * d),)),
        # TE's MoE layers keep a separate pre_mlp_layernorm (TENorm), whose key is its own name; the local
        # spec saves it under the fused name for both layer kinds, which is the key written here
        layer("pre_mlp_layernorm.weight", "pre_mlp_layernorm.weight" if sparse else "mlp.linear_fc1.layer_norm_weight",
              ("post_attention_layernorm.weight",), ((hidden,),), key="mlp.linear_fc1.layer_norm_weight"),
    ]
    if dense != ():
        maps += [
            layer("mlp.linear_fc1.weight", "mlp.linear_fc1.weight",
                  ("mlp.gate_proj.weight", "mlp.up_proj.weight"), ((ffn, hidden), (ffn, hidden)),
                  fc1_fuse, split_gate_up, dense),
            layer("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", ("mlp.down_proj.weight",), ((hidden, ffn),),
                  layers=dense),
        ]
    if sparse:
        maps += _moe_maps(model, model_type, tuple(sparse), layer, fc1_fuse)
    maps += [
        TensorMap("decoder.final_layernorm.weight", "decoder.final_layernorm.weight",
                  "decoder.final_layernorm.weight", ("model.norm.weight",), ((hidden,),), False,
                  _identity, _unwrap),
    ]
    if not model.share_embeddings_and_output_weights:
        maps.append(TensorMap("output_layer.weight", "output_layer.weight", "output_layer.weight",
                              ("lm_head.weight",), ((vocab, hidden),), False, _identity, _unwrap))
    return maps


def _moe_maps(model: ModelConfig, model_type: str, layers: tuple[int, ...], layer: Callable,
              fc1_fuse: Callable) -> list[TensorMap]:
    """Router and local experts of the MoE layers ``layers``, named as ``model_type`` names them."""
    if model_type == "gpt_oss":
        return _gpt_oss_moe_maps(model, layers, layer)
    if model_type not in HF_MOE_NAMES:
        raise ValueError(f"model_type={model_type!r} has no Hugging Face MoE naming here; MoE layers are "
                         f"mapped for {sorted(HF_MOE_NAMES)}")
    router, prefix, gate, up, down = HF_MOE_NAMES[model_type]
    experts, hidden = model.num_moe_experts, model.hidden_size
    ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
    local = "mlp.experts.local_experts.{expert}."
    key = "mlp.experts.experts."
    return [
        layer("mlp.router.weight", "mlp.router.weight", (router,), ((experts, hidden),), layers=layers),
        layer(local + "linear_fc1.weight", local + "linear_fc1.weight", (prefix + gate, prefix + up),
              ((ffn, hidden), (ffn, hidden)), fc1_fuse, split_gate_up, layers, experts, key + "linear_fc1.weight"),
        layer(local + "linear_fc2.weight", local + "linear_fc2.weight", (prefix + down,), ((hidden, ffn),),
              layers=layers, experts=experts, key=key + "linear_fc2.weight"),
    ]


def _mla_maps(model: ModelConfig, model_type: str, maps: list[TensorMap], layer: Callable, fc1_fuse: Callable,
              sparse: list[int], dense: Optional[tuple[int, ...]]) -> list[TensorMap]:
    """DeepSeek-V3's multi-latent attention (local-spec names and keys: its norms are not fused into a
    linear), then its MLP (dense layers, routed experts with the router's expert bias, shared experts).
    The projections map as they are: megatron-core's MLA de-interleaves the RoPE dims of q and k itself
    (``rope_utils._apply_rotary_pos_emb_bshd(multi_latent_attention=True)``), as transformers'
    ``rope_interleave`` does."""
    h, hidden, vocab = model.num_attention_heads, model.hidden_size, model.vocab_size
    q_lora, kv_lora, rope = model.q_lora_rank, model.kv_lora_rank, model.qk_pos_emb_head_dim
    qk, v = model.qk_head_dim + rope, model.v_head_dim

    attn = "self_attention."
    maps += [
        layer("input_layernorm.weight", "input_layernorm.weight", ("input_layernorm.weight",), ((hidden,),)),
        layer(attn + "linear_q_down_proj.weight", attn + "linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",),
              ((q_lora, hidden),)),
        layer(attn + "q_layernorm.weight", attn + "q_layernorm.weight", ("self_attn.q_a_layernorm.weight",),
              ((q_lora,),)),
        layer(attn + "linear_q_up_proj.weight", attn + "linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",),
              ((h * qk, q_lora),)),
        layer(attn + "linear_kv_down_proj.weight", attn + "linear_kv_down_proj.weight",
              ("self_attn.kv_a_proj_with_mqa.weight",), ((kv_lora + rope, hidden),)),
        layer(attn + "kv_layernorm.weight", attn + "kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",),
              ((kv_lora,),)),
        layer(attn + "linear_kv_up_proj.weight", attn + "linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",),
              ((h * (model.qk_head_dim + v), kv_lora),)),
        layer(attn + "linear_proj.weight", attn + "linear_proj.weight", ("self_attn.o_proj.weight",),
              ((hidden, h * v),)),
        layer("pre_mlp_layernorm.weight", "pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",),
              ((hidden,),)),
    ]
    if dense != ():
        ffn = model.ffn_hidden_size
        maps += [layer("mlp.linear_fc1.weight", "mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                       ((ffn, hidden), (ffn, hidden)), fc1_fuse, split_gate_up, dense),
                 layer("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", ("mlp.down_proj.weight",), ((hidden, ffn),),
                       layers=dense)]
    if sparse:
        layers = tuple(sparse)
        maps += _moe_maps(model, model_type, layers, layer, fc1_fuse)
        if model.moe_router_enable_expert_bias:
            maps.append(layer("mlp.router.expert_bias", "mlp.router.expert_bias",
                              ("mlp.gate.e_score_correction_bias",), ((model.num_moe_experts,),), layers=layers))
        shared = model.moe_shared_expert_intermediate_size
        if shared:
            maps += [layer("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight",
                           ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
                           ((shared, hidden), (shared, hidden)), fc1_fuse, split_gate_up, layers),
                     layer("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight",
                           ("mlp.shared_experts.down_proj.weight",), ((hidden, shared),), layers=layers)]
    maps.append(TensorMap("decoder.final_layernorm.weight", "decoder.final_layernorm.weight",
                          "decoder.final_layernorm.weight", ("model.norm.weight",), ((hidden,),), False,
                          _identity, _unwrap))
    if not model.share_embeddings_and_output_weights:
        maps.append(TensorMap("output_layer.weight", "output_layer.weight", "output_layer.weight",
                              ("lm_head.weight",), ((vocab, hidden),), False, _identity, _unwrap))
    return maps


def interleaved_to_gate_up(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's ``[..., 2f]`` with gate and up interleaved (``t[..., ::2]`` gate, ``t[..., 1::2]`` up)
    -> ``[..., 2f]`` as ``[gate | up]``."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def gate_up_to_interleaved(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_gate_up`."""
    gate, up = torch.chunk(t, 2, dim=-1)
    return torch.stack([gate, up], dim=-1).reshape(t.shape).contiguous()


def _gpt_oss_moe_maps(model: ModelConfig, layers: tuple[int, ...], layer: Callable) -> list[TensorMap]:
    """gpt-oss's router (with bias) and experts: ``gate_up_proj [E, hidden, 2f]`` (interleaved) is the
    experts' ``linear_fc1 [E, 2f, hidden]`` transposed, ``down_proj [E, f, hidden]`` their ``linear_fc2``
    transposed; the biases likewise (``gate_up_proj_bias [E, 2f]`` interleaved)."""
    experts, hidden = model.num_moe_experts, model.hidden_size
    ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
    local, key, hf = "mlp.experts.local_experts.{expert}.", "mlp.experts.experts.", GPT_OSS_EXPERTS

    def one(fuse: Callable[[torch.Tensor], torch.Tensor], split: Callable[[torch.Tensor], torch.Tensor]):
        return (lambda ts: fuse(ts[0]).contiguous()), (lambda t: [split(t).contiguous()])

    fc1_w = one(lambda t: interleaved_to_gate_up(t).transpose(1, 2),
                lambda t: gate_up_to_interleaved(t.transpose(1, 2)))
    fc1_b = one(interleaved_to_gate_up, gate_up_to_interleaved)
    fc2_w = one(lambda t: t.transpose(1, 2), lambda t: t.transpose(1, 2))

    def expert_map(name: str, hf_name: str, hf_shape: tuple[int, ...], shape: tuple[int, ...], fs) -> TensorMap:
        tmap = layer(local + name, local + name, (hf + hf_name,), (hf_shape,), *fs, layers, experts, key + name)
        return dataclasses.replace(tmap, expert_shape=shape)

    return [
        layer("mlp.router.weight", "mlp.router.weight", ("mlp.router.weight",), ((experts, hidden),), layers=layers),
        layer("mlp.router.bias", "mlp.router.bias", ("mlp.router.bias",), ((experts,),), layers=layers),
        expert_map("linear_fc1.weight", "gate_up_proj", (experts, hidden, 2 * ffn), (2 * ffn, hidden), fc1_w),
        expert_map("linear_fc1.bias", "gate_up_proj_bias", (experts, 2 * ffn), (2 * ffn,), fc1_b),
        expert_map("linear_fc2.weight", "down_proj", (experts, ffn, hidden), (hidden, ffn), fc2_w),
        expert_map("linear_fc2.bias", "down_proj_bias", (experts, hidden), (hidden,), one(lambda t: t, lambda t: t)),
    ]


def hf_tensors(model: ModelConfig, model_type: str = "llama") -> list[tuple[str, tuple[int, ...], TensorMap]]:
    """Every Hugging Face tensor of ``model`` as ``(name, shape, its TensorMap)``, in mapping order."""
    return [(name, shape, tmap) for tmap in tensor_maps(model, model_type) for slot in slots(tmap, model)
            for name, shape in zip(hf_names_at(tmap, slot), tmap.hf_shapes)]


def extra_state_keys(model: ModelConfig) -> list[str]:
    """The ``_extra_state`` object keys megatron-core's loader asks for, as ``dist_checkpointing`` names
    a ``ShardedObject``: ``KEY/shard_<offsets>_<shape>`` (dot-joined), per layer or (layer, expert)."""
    num_layers, sparse = model.num_layers, set(moe_layers(model))
    keys = []
    for i in range(num_layers):
        attention = MLA_EXTRA_STATE_MODULES if model.multi_latent_attention else ATTENTION_EXTRA_STATE_MODULES
        shared = SHARED_EXPERT_EXTRA_STATE_MODULES if model.moe_shared_expert_intermediate_size else ()
        modules = attention + (shared if i in sparse else DENSE_MLP_EXTRA_STATE_MODULES)
        # keyed per layer, with no layer offset, where the layers are not all alike
        prefix, offset, shape = (f"{LAYER_KEY_PREFIX}{i}.", (), ()) if non_homogeneous(model) else \
            (LAYER_KEY_PREFIX, (i,), (num_layers,))
        keys += [f"{prefix}{module}._extra_state/{_shard(offset or (0,), shape or (1,))}" for module in modules]
        if i in sparse:
            experts = model.num_moe_experts
            keys += [f"{prefix}{module}._extra_state/{_shard(offset + (e,), shape + (experts,))}"
                     for module in EXPERT_EXTRA_STATE_MODULES for e in range(experts)]
    return keys


def _shard(offset: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """A ``ShardedObject``'s key suffix: ``shard_<offsets>_<shape>``, each dot-joined."""
    return f"shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"
