"""A tiny GPTModel built with our layer spec under CP (and TP+SP) matches the same model at CP=1.

The reference is megatron-core's own local spec (its ``DotProductAttention``) at TP=1, CP=1 on the
full sequence, so the check is independent of our engine. Compared, within 1e-5 (fp32): every
token's loss (each CP rank's zigzag shard of it), the loss averaged over the valid tokens of all CP
ranks (a loss mask with holes makes a per-rank average differ), and every parameter gradient after
the gradient reduction megatron-core performs (sum over CP; SP norm grads summed over TP).
"""
from __future__ import annotations

import pytest
import torch

import megatron_patches
from tests._dist import run_distributed
from tests.tiny_gpt import batch, init_parallel, tiny_config, tiny_gpt, tp_shard

SEQ = 16
TOL = dict(atol=1e-5, rtol=1e-5)


def _loss_mask():
    mask = torch.ones(2, SEQ)
    mask[0, 3:9] = 0  # holes that fall unevenly on the CP ranks
    mask[1, -2:] = 0
    return mask


def _reference(**extra):
    """Per-token loss, masked mean and grads of the stock model at TP=1, CP=1 (full sequence)."""
    from megatron.core import parallel_state

    init_parallel()
    try:
        model = tiny_gpt(tiny_config(**extra), seq=SEQ)
        tokens, positions, labels = batch(SEQ)
        per_token = model(tokens, positions, None, labels=labels)
        mask = _loss_mask()
        loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return params, per_token.detach(), loss.item(), grads
    finally:
        parallel_state.destroy_model_parallel()


def _parity(rank, world, tp, cp, sizes, comm, extra=None):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    from mcp_context.megatron import masked_token_mean, slice_batch_for_cp
    from mcp_context.megatron.specs import get_gpt_layer_hcp_spec

    megatron_patches.apply_all(device="cpu")
    extra = extra or {}
    params, ref_per_token, ref_loss, ref_grads = _reference(**extra)
    init_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                  hierarchical_context_parallel_sizes=sizes)
    try:
        config = tiny_config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, context_parallel_size=cp,
                             hierarchical_context_parallel_sizes=sizes, cp_comm_type=comm, **extra)
        model = tiny_gpt(config, get_gpt_layer_hcp_spec(), seq=SEQ)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(tp_shard(name, params[name], tp_rank, tp))
        tokens, positions, labels = batch(SEQ)
        local = slice_batch_for_cp({"tokens": tokens, "position_ids": positions, "labels": labels,
                                    "loss_mask": _loss_mask(), "reference": ref_per_token})
        per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
        cp_group = parallel_state.get_context_parallel_group()
        loss, global_mean = masked_token_mean(per_token, local["loss_mask"], cp_group)
        loss.backward()
        for param in model.parameters():  # what DDP does over the CP (x DP) group
            torch.distributed.all_reduce(param.grad, group=cp_group)
        model.ddp_config = DistributedDataParallelConfig()
        _allreduce_non_tensor_model_parallel_grads([model], config)  # SP norm grads over TP
        torch.testing.assert_close(per_token.detach(), local["reference"], **TOL)
        assert abs(global_mean.item() - ref_loss) <= 1e-5 * abs(ref_loss)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, tp_shard(name, ref_grads[name], tp_rank, tp), **TOL,
                                       msg=lambda m: f"{name}: {m}")
        return global_mean.item()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world,tp,cp,sizes,comm", [
    (2, 1, 2, None, "p2p"),
    (4, 1, 4, None, "p2p"),
    (4, 1, 4, None, "a2a"),
    (4, 1, 4, [2, 2], "a2a+p2p"),
    (4, 1, 4, [2, 2], "p2p"),
    (4, 1, 4, [2, 2], "a2a"),
    (4, 1, 4, [2, 2], "all_gather"),
    (4, 2, 2, None, "p2p"),
    (4, 2, 2, None, "a2a"),
    (4, 1, 4, [2, 2], ["a2a+p2p", "p2p"]),  # per-layer types (megatron_patches fixes 0.16.1's indexing)
])
def test_gpt_with_hcp_spec_matches_cp1_losses_and_gradients(world, tp, cp, sizes, comm):
    losses = run_distributed(world, _parity, tp, cp, sizes, comm)
    assert len(set(losses)) == 1  # every rank reports the same global mean


@pytest.mark.parametrize("comm", ["a2a+p2p", "p2p"])
@pytest.mark.parametrize("extra", [dict(window_size=(5, 0)), dict(window_size=(1, 0), window_attn_skip_freq=2)],
                         ids=["window5-every-layer", "window1-alternating"])
def test_gpt_with_sliding_windows_matches_cp1_losses_and_gradients(comm, extra):
    """Sliding-window layers at CP=4 as [2, 2] against megatron-core's own local attention with the same
    window at CP=1: a window of 5 spans several zigzag chunks of 2 tokens; a window of 1 stays inside one,
    on layer 1 only (window_attn_skip_freq=2: layer 2 attends in full). Same tolerances as above."""
    losses = run_distributed(4, _parity, 1, 4, [2, 2], comm, extra)
    assert len(set(losses)) == 1
