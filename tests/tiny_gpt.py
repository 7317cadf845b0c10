"""A tiny megatron-core GPT (RoPE, GQA, SwiGLU, RMSNorm, fp32) for tests, and how its weights shard.

Shared by the patch tests and the Megatron-integration tests so both build the same model.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

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
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):  # set by the last model's
        os.environ.pop(name, None)  # attention_backend; megatron-core asserts them against the next one's
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


# ---- parity of many model variants in one distributed call (worlds built once per call) ----

TOL = dict(atol=1e-5, rtol=1e-5)  # fp32


@dataclasses.dataclass(frozen=True)
class ParityCase:
    """One model variant: ``config`` fields for both models, ``layer`` arguments for megatron-core's
    ``get_gpt_layer_local_spec`` (the reference, CP=1) and our ``get_gpt_layer_hcp_spec`` (CP>1), the
    ``cp_comm_type`` values to run. ``mla``: an ``MLATransformerConfig``; megatron-core 0.16.1 has no local
    MLA attention, so the reference is our own model at CP=1."""
    name: str
    config: tuple = ()  # (field, value) pairs: hashable, picklable
    layer: tuple = ()
    comms: tuple = ("p2p", "a2a+p2p")
    mla: bool = False


MLA_FIELDS = dict(q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                  rope_type="rope", qk_layernorm=True)  # DeepSeek-V3's shape, tiny: dqk = 12, dv = 6


def case_config(case: ParityCase, **parallel):
    """The case's ``TransformerConfig`` (or ``MLATransformerConfig``) with the parallel fields given."""
    fields = dict(case.config, **parallel)
    if not case.mla:
        return tiny_config(**fields)
    from megatron.core.transformer import MLATransformerConfig

    base = dataclasses.asdict(tiny_config())
    base = {k: v for k, v in base.items() if k in {f.name for f in dataclasses.fields(MLATransformerConfig)}
            and not k.startswith("_") and k not in ("kv_channels", "multi_latent_attention")}
    base.update(MLA_FIELDS, **fields)
    return MLATransformerConfig(**base)


@contextlib.contextmanager
def current_device_is_cpu():
    """megatron-core 0.16.1's ``DotProductAttention`` puts ``softmax_offset`` on ``torch.cuda.current_device()``:
    build the stock model with the CPU as the current device."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = original


def loss_mask(seq: int):
    mask = torch.ones(BATCH, seq)
    mask[0, 3:9] = 0  # holes that fall unevenly on the CP ranks
    mask[1, -2:] = 0
    return mask


def hcp_spec(case: ParityCase):
    """Our layer spec for the case (MLA with its latent norms, as MLA_FIELDS configures)."""
    from mcp_context.megatron.specs import get_gpt_layer_hcp_spec

    layer = dict(case.layer)
    if case.mla:
        layer.update(multi_latent_attention=True, qk_layernorm=dict(case.config).get("qk_layernorm", True))
    return get_gpt_layer_hcp_spec(**layer)


def _reference(case: ParityCase, seq: int) -> dict:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(0)
    spec = (hcp_spec(case) if case.mla else get_gpt_layer_local_spec(normalization="RMSNorm", **dict(case.layer)))
    with current_device_is_cpu():
        model = tiny_gpt(case_config(case), spec, seq=seq)
    tokens, positions, labels = batch(seq)
    per_token = model(tokens, positions, None, labels=labels)
    mask = loss_mask(seq)
    ((per_token * mask).sum() / mask.sum()).backward()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "per_token": per_token.detach()}


def _compare(case: ParityCase, comm, cp: int, sizes, ref: dict, seq: int) -> list[str]:
    """Our model at CP=cp against ``ref``: every token's loss and every gradient summed over CP (what
    megatron-core's DDP does over its DP x CP group). Returns the mismatches, one line each."""
    from megatron.core import parallel_state

    from mcp_context.megatron import masked_token_mean, slice_batch_for_cp

    config = case_config(case, context_parallel_size=cp, hierarchical_context_parallel_sizes=sizes,
                         cp_comm_type=comm)
    model = tiny_gpt(config, hcp_spec(case), seq=seq)
    names = {n for n, _ in model.named_parameters()}
    if names != set(ref["params"]):
        return [f"{case.name} {comm}: parameters differ from the reference: {sorted(names ^ set(ref['params']))}"]
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(ref["params"][name])
    tokens, positions, labels = batch(seq)
    local = slice_batch_for_cp({"tokens": tokens, "position_ids": positions, "labels": labels,
                                "loss_mask": loss_mask(seq), "reference": ref["per_token"]})
    per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
    cp_group = parallel_state.get_context_parallel_group()
    masked_token_mean(per_token, local["loss_mask"], cp_group)[0].backward()
    where = f"{case.name} cp={cp} {comm}"
    errors = _mismatch(f"{where} per-token loss", per_token.detach(), local["reference"])
    for name, param in model.named_parameters():
        torch.distributed.all_reduce(param.grad, group=cp_group)
        errors += _mismatch(f"{where} grad {name}", param.grad, ref["grads"][name])
    return errors


def _mismatch(what: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    try:
        torch.testing.assert_close(got, want, **TOL)
    except AssertionError:
        return [f"{what}: max |diff| {(got - want).abs().max().item():.3g}"]
    return []


def parity_cases(rank, world, cases, worlds, seq: int = 16) -> list[str]:
    """Distributed case: every case's reference at CP=1, then ours at each ``(cp, sizes)`` of ``worlds``
    for each of its ``comms``; parallel state is initialised once per world, not once per case."""
    import megatron_patches
    from megatron.core import parallel_state

    megatron_patches.apply_all(device="cpu")
    init_parallel()
    try:
        refs = {case.name: _reference(case, seq) for case in cases}
    finally:
        parallel_state.destroy_model_parallel()
    errors = []
    for cp, sizes in worlds:
        init_parallel(context_parallel_size=cp, hierarchical_context_parallel_sizes=sizes)
        try:
            for case in cases:
                for comm in case.comms:
                    if comm == "a2a+p2p" and sizes is None:
                        continue
                    errors += _compare(case, comm, cp, sizes, refs[case.name], seq)
        finally:
            parallel_state.destroy_model_parallel()
    return errors
