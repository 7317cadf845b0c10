"""Packed sequences through Megatron: a packed batch at CP=4 [2,2] against the same documents one by one at
CP=1 (megatron-core's own attention), thd ``packed_seq_params`` refused where we cannot run them, and
``slice_batch_for_cp`` cutting packed batches per document."""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed

MEGATRON_DOCS = [5, 1, 9, 3, 12]  # packed at CP = 4: each padded to a multiple of 8, then 8 rows of tail


def _megatron_packing():
    cu, padded = [0], [0]
    for n in MEGATRON_DOCS:
        cu.append(cu[-1] + n)
        padded.append(padded[-1] + n + (-n % 8))
    padded[-1] += 8
    return cu, padded


def _megatron_packed_parity(rank, world):
    """Every document alone through megatron-core's own local spec at CP = 1, against the packed batch
    through our spec at CP = 4 as [2, 2] (a2a+p2p) with packed_seq_params (thd)."""
    import megatron_patches
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcp_context.megatron import masked_token_mean, slice_batch_for_cp
    from mcp_context.megatron.specs import get_gpt_layer_hcp_spec
    from tests.tiny_gpt import VOCAB, init_parallel, tiny_config, tiny_gpt

    megatron_patches.apply_all(device="cpu")
    cu, padded = _megatron_packing()
    seq = padded[-1]
    gen = torch.Generator().manual_seed(3)
    docs = [(torch.randint(0, VOCAB, (1, n), generator=gen), torch.randint(0, VOCAB, (1, n), generator=gen))
            for n in MEGATRON_DOCS]
    total = sum(MEGATRON_DOCS)
    init_parallel()
    try:  # the reference: documents one by one, loss averaged over all their tokens
        model = tiny_gpt(tiny_config(), seq=seq)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        per_doc = [model(tokens, torch.arange(tokens.shape[1])[None], None, labels=labels) for tokens, labels in docs]
        (sum(loss.sum() for loss in per_doc) / total).backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        parallel_state.destroy_model_parallel()
    tokens, labels = torch.zeros(1, seq, dtype=torch.long), torch.zeros(1, seq, dtype=torch.long)
    loss_mask, reference = torch.zeros(1, seq), torch.zeros(1, seq)
    for (t, lab), start, n, loss in zip(docs, padded, MEGATRON_DOCS, per_doc):
        tokens[0, start:start + n], labels[0, start:start + n] = t[0], lab[0]
        loss_mask[0, start:start + n], reference[0, start:start + n] = 1, loss.detach()[0]
    init_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    try:
        config = tiny_config(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2],
                             cp_comm_type="a2a+p2p")
        model = tiny_gpt(config, get_gpt_layer_hcp_spec(), seq=seq)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(params[name])
        cp_group = parallel_state.get_context_parallel_group()
        cu_t, padded_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)
        longest = max(b - a for a, b in zip(padded, padded[1:]))
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, cu_seqlens_q_padded=padded_t,
                                 cu_seqlens_kv_padded=padded_t, max_seqlen_q=longest, max_seqlen_kv=longest,
                                 cp_group=cp_group)
        local = slice_batch_for_cp({"tokens": tokens, "position_ids": torch.arange(seq)[None], "labels": labels,
                                    "loss_mask": loss_mask, "reference": reference}, cp_group, packed)
        from mcp_context import masks

        parse, parses = masks._offsets, []
        masks._offsets = lambda *args: parses.append(args[0]) or parse(*args)  # count the offsets' parses
        try:
            per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                              packed_seq_params=packed)
        finally:
            masks._offsets = parse
        loss, _ = masked_token_mean(per_token, local["loss_mask"], cp_group)
        loss.backward()
        for param in model.parameters():
            torch.distributed.all_reduce(param.grad, group=cp_group)
        valid = local["loss_mask"] > 0
        loss_err = (per_token.detach()[valid] - local["reference"][valid]).abs().max().item()
        grad_err = max(((p.grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1)).item()
                       for n, p in model.named_parameters())
        return loss_err, grad_err, int(valid.sum()), parses, config.num_layers
    finally:
        parallel_state.destroy_model_parallel()


def test_megatron_gpt_packed_batch_at_cp4_matches_documents_one_by_one_at_cp1():
    """A packed batch (documents of 5, 1, 9, 3 and 12 tokens, each padded to a multiple of 2*cp = 8, and a
    tail of padding) through our spec at CP = 4 as [2, 2] with packed_seq_params: every valid token's loss
    and every gradient (fp32) match megatron-core's own attention running each document alone at CP = 1."""
    results = run_distributed(4, _megatron_packed_parity)
    assert sum(r[2] for r in results) == sum(MEGATRON_DOCS)
    for rank, (loss_err, grad_err, _, parses, layers) in enumerate(results):
        assert loss_err <= 1e-5 and grad_err <= 1e-5, (rank, loss_err, grad_err)
        # the step's offsets are parsed once (by the first of the layers), not once per layer
        assert layers >= 2 and parses == ["cu_seqlens", "cu_seqlens_padded"], (rank, layers, parses)


@pytest.mark.parametrize("field,value,match", [
    ("qkv_format", "sbhd", r"does not support packed sequences with packed_seq_params.qkv_format='sbhd'; pass "
                           r"megatron-core's PackedSeqParams with qkv_format='thd'"),
    ("cu_seqlens_kv", torch.tensor([0, 8, 16], dtype=torch.int32), r"cu_seqlens_kv differs from cu_seqlens_q"),
])
def test_megatron_refuses_packings_it_cannot_run(field, value, match):
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcp_context.megatron.core_attention import _packed_documents

    cu = torch.tensor([0, 4, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    setattr(params, field, value)
    with pytest.raises(NotImplementedError, match=match):
        _packed_documents(params, None)  # refused before any process group is needed


def _slice_packed_case(rank, world):
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcp_context.megatron import slice_batch_for_cp

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    padded = torch.tensor([0, 4, 12], dtype=torch.int32)  # documents of 3 and 5 rows padded to 4 and 8
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=padded)
    local = slice_batch_for_cp({"tokens": torch.arange(12)[None], "position_ids": torch.arange(12)[None],
                                "attention_mask": None}, torch.distributed.group.WORLD, params)
    return local["tokens"].tolist(), local["position_ids"].tolist(), local["attention_mask"]


def test_slice_batch_for_cp_cuts_packed_batches_per_document():
    """cp = 2: rank r holds chunks r and 3-r of each document (1 and 2 rows), positions restart per document."""
    assert run_distributed(2, _slice_packed_case) == [([[0, 3, 4, 5, 10, 11]], [[0, 3, 0, 1, 6, 7]], None),
                                                      ([[1, 2, 6, 7, 8, 9]], [[1, 2, 2, 3, 4, 5]], None)]
