"""A tiny megatron-core GPT (RoPE, GQA, SwiGLU, RMSNorm, fp32) for tests, and how its weights shard.

Shared by the patch tests and the Megatron-integration tests so both build the same model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SEQ, BATCH, VOCAB = 8, 2, 64
HIDDEN, HEADS, GROUPS, FFN, LAYERS = 32, 4, 2, 48, 2
EPS = 1e-5


def tiny_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        layernorm_epsilon=EPS, add_bias_linear=False, use_cpu_initialization=True, init_method_std=0.1,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
        bias_activation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, params_dtype=torch.float32,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def tiny_gpt(config, layer_spec=None, seq: int = SEQ):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = layer_spec if layer_spec is not None else get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=VOCAB,
                    max_sequence_length=seq, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def batch(seq: int = SEQ):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, seq), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, seq), generator=generator)
    return tokens, torch.arange(seq).expand(BATCH, seq), labels


def run_gpt(model, tokens, positions, labels, gather_logits=True):
    """Logits [b, s, vocab] (gathered over TP), per-token loss [b, s], and grads after sum(loss)."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens, positions, None, runtime_gather_output=gather_logits)
    loss = model(tokens, positions, None, labels=labels)
    loss.sum().backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The TP shard of a TP=1 parameter (or gradient) `name` held by `tp_rank`."""
    if name.endswith("linear_fc1.weight"):  # SwiGLU: each rank holds [its gate rows; its up rows]
        return torch.cat([half.chunk(tp_size, 0)[tp_rank] for half in full.chunk(2, 0)])
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
        return full.chunk(tp_size, 0)[tp_rank]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp_size, 1)[tp_rank]
    return full


def init_parallel(**kwargs):
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(**kwargs)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
