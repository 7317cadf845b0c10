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
from tests.tiny_gpt import HEADS, ParityCase, batch, init_parallel, parity_cases, tiny_config, tiny_gpt, tp_shard

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


# ---- attention sinks (softmax_type) and MLA: many variants per distributed call ----

SINK_COMMS = ("p2p", "a2a+p2p", "all_gather", "a2a")  # a2a at CP=4 replicates the 2 KV heads


def test_sinks_match_megatron_cores_attention_at_cp1():
    """softmax_type 'off-by-one' and 'learnable', without and with a window on alternate layers, at CP=4 as
    [2, 2] in every comm type, against megatron-core's own DotProductAttention (which applies the offset)
    at CP=1: every token's loss and every gradient, softmax_offset's (summed over CP) included, 1e-5."""
    cases = [ParityCase(f"{kind}{'-window' if window else ''}",
                        (("softmax_type", kind),) + ((("window_size", (3, 0)), ("window_attn_skip_freq", 2))
                                                     if window else ()), comms=SINK_COMMS)
             for kind in ("off-by-one", "learnable") for window in (False, True)]
    errors = run_distributed(4, parity_cases, cases, [(4, [2, 2])])
    assert not errors[0], "\n".join(errors[0])


def test_mla_model_at_cp2_and_cp4_equals_cp1():
    """DeepSeek-V3-style multi-latent attention (q/kv LoRA with latent norms, dqk = 8 + 4 RoPE dims, dv = 6;
    RoPE and YaRN) at CP=2 and CP=4 as [2, 2] equals the same model at CP=1 (megatron-core
    0.16.1 has no local MLA attention; the engine's tests compare MLA with an fp64 reference)."""
    yarn = (("rope_type", "yarn"), ("rotary_scaling_factor", 4.0), ("original_max_position_embeddings", 16),
            ("mscale", 0.7), ("mscale_all_dim", 0.7), ("beta_fast", 8.0), ("beta_slow", 2.0),
            ("rotary_base", 5000), ("rotary_percent", 1.0))
    cases = [ParityCase("mla", mla=True, comms=("p2p", "a2a", "all_gather", "a2a+p2p")),
             ParityCase("mla-yarn", yarn, mla=True, comms=("a2a+p2p",))]
    errors = run_distributed(4, parity_cases, cases, [(2, None), (4, [2, 2])])
    assert not errors[0], "\n".join(errors[0])


def _deterministic_grads(rank, world):
    from megatron.core import parallel_state

    from mcp_context.megatron import masked_token_mean, slice_batch_for_cp
    from mcp_context.megatron.specs import hcp_local_spec

    megatron_patches.apply_all(device="cpu")
    init_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    try:
        runs = []
        for _ in range(2):
            torch.manual_seed(0)
            config = tiny_config(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2],
                                 cp_comm_type="a2a+p2p", deterministic_mode=True, softmax_type="learnable")
            model = tiny_gpt(config, hcp_local_spec, seq=SEQ)
            tokens, positions, labels = batch(SEQ)
            local = slice_batch_for_cp({"tokens": tokens, "position_ids": positions, "labels": labels,
                                        "loss_mask": _loss_mask()})
            per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
            masked_token_mean(per_token, local["loss_mask"], parallel_state.get_context_parallel_group())[0].backward()
            runs.append({n: p.grad.clone() for n, p in model.named_parameters()})
        return all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    finally:
        parallel_state.destroy_model_parallel()


def test_deterministic_mode_gives_bitwise_equal_gradients_at_cp4():
    """deterministic_mode=True on the CPU: two runs at CP=4 as [2, 2] give bitwise-equal gradients (it holds
    by construction: fixed ring and merge order, one thread per rank). On CUDA it is refused unless
    attention_backend picks the math kernel (tests/test_megatron_config.py)."""
    assert all(run_distributed(4, _deterministic_grads))


def _offsets(rank, world):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mcp_context.megatron.specs import hcp_local_spec
    from tests.tiny_gpt import current_device_is_cpu

    megatron_patches.apply_all(device="cpu")
    init_parallel(tensor_model_parallel_size=2)
    try:
        made = {}
        for kind in ("off-by-one", "learnable"):
            for who, spec in (("stock", get_gpt_layer_local_spec(normalization="RMSNorm")), ("ours", hcp_local_spec)):
                torch.manual_seed(7)
                with current_device_is_cpu():
                    model = tiny_gpt(tiny_config(tensor_model_parallel_size=2, softmax_type=kind), spec)
                core = model.decoder.layers[1].self_attention.core_attention
                made[kind, who] = (core.softmax_offset, {n for n, _ in model.named_parameters()},
                                   set(model.state_dict()))
        return made
    finally:
        parallel_state.destroy_model_parallel()


def test_softmax_offset_is_made_like_megatron_cores():
    """Same name, shape [heads per TP partition], dtype, initial values (config.init_method under the same
    seed) and parameter/state-dict names as megatron-core's DotProductAttention, at TP=2; 'off-by-one' is
    zeros and not a parameter."""
    for made in run_distributed(2, _offsets):
        for kind in ("off-by-one", "learnable"):
            (stock, stock_params, stock_state), (ours, our_params, our_state) = made[kind, "stock"], made[kind, "ours"]
            assert ours.shape == stock.shape == (HEADS // 2,) and ours.dtype == stock.dtype
            assert isinstance(ours, torch.nn.Parameter) == isinstance(stock, torch.nn.Parameter) == (kind == "learnable")
            torch.testing.assert_close(ours, stock, atol=0, rtol=0)
            assert our_params == stock_params and our_state == stock_state


def _mla_core_attention_against_fp64(rank, world):
    """Our CP=1 MLA model's core attention, on the q, k, v its MLA projections and RoPE produce, against
    causal attention written here in fp64 with MLA's scale 1/sqrt(qk_head_dim + qk_pos_emb_head_dim)."""
    from megatron.core import parallel_state

    from tests.tiny_gpt import MLA_FIELDS, ParityCase, batch, case_config, hcp_spec, init_parallel, tiny_gpt

    megatron_patches.apply_all(device="cpu")
    init_parallel()
    try:
        torch.manual_seed(0)
        case = ParityCase("mla", mla=True)
        model = tiny_gpt(case_config(case), hcp_spec(case), seq=16)
        seen = []

        def keep(module, args, kwargs, out):
            seen.append((args[:3], out))

        hooks = [m.register_forward_hook(keep, with_kwargs=True) for m in model.modules()
                 if type(m).__name__ == "HCPDotProductAttention"]
        tokens, positions, labels = batch(16)
        model(tokens, positions, None, labels=labels)
        for h in hooks:
            h.remove()
        scale = (MLA_FIELDS["qk_head_dim"] + MLA_FIELDS["qk_pos_emb_head_dim"]) ** -0.5
        errors = []
        for (q, k, v), out in seen:
            assert q.shape[-1] == 12 and v.shape[-1] == MLA_FIELDS["v_head_dim"]
            dout = torch.randn_like(out)
            got = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
            scores = torch.einsum("sbhd,tbhd->bhst", q64, k64) * scale
            s = q.shape[0]
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v64).reshape(out.shape)
            want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
            errors.append(max([(out.double() - ref).abs().max().item()]
                              + [(a.double() - b).abs().max().item() for a, b in zip(got, want)]))
        return len(seen), max(errors)
    finally:
        parallel_state.destroy_model_parallel()


def test_mla_core_attention_at_cp1_equals_an_fp64_reference():
    """The CP=1 end of the MLA parity chain: every layer's core attention output and its q/k/v gradients
    equal fp64 causal attention with MLA's head dims (dqk = 12, dv = 6) and scale, within 1e-5 (fp32)."""
    layers, err = run_distributed(1, _mla_core_attention_against_fp64)[0]
    assert layers >= 2 and err <= 1e-5, (layers, err)
