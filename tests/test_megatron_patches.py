"""Tests for megatron_patches on megatron-core 0.16.x, CPU and gloo.

A tiny GPTModel (local spec, RoPE, GQA, SwiGLU, RMSNorm, fp32) is checked against an independent
fp64 re-implementation (logits, per-token loss, every gradient) at TP=1, and at TP=2 with sequence
parallelism against TP=1; RoPE's CP slicing against positions computed by hand; the RNG tracker
against a separately seeded generator and activation recomputation with dropout; the hierarchical
CP groups across destroy / re-initialise; and per-layer `cp_comm_type` with a pipeline offset.

Every test means the CPU: it applies the patches with ``device="cpu"`` (so it runs the same on a
machine with CUDA), and only in worker processes, since the CPU shims hold for the rest of a process
and the test runner's own process may go on to run megatron-core on a GPU.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_patches
from tests._dist import run_distributed
from tests.tiny_gpt import (BATCH, EPS, GROUPS, HEADS, HIDDEN, LAYERS, SEQ, batch, init_parallel, run_gpt,
                            tiny_config, tiny_gpt, tp_shard)

# fp32 model vs fp64 reference; measured max errors: logits 5e-7, loss 6e-7, grads 1.6e-6 (|grad| <= 5)
FP64_TOL = dict(atol=2e-5, rtol=1e-4)
# TP=2 + SP vs TP=1, both fp32; measured max errors: logits 5e-7, loss 1e-6, grads 1.4e-6
TP_TOL = dict(atol=1e-5, rtol=1e-5)


def _reference_logits(params: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Independent fp64 forward of the tiny GPT from its parameters: logits [b, s, vocab]."""
    head_dim, q_per_group = HIDDEN // HEADS, HEADS // GROUPS
    b, s = tokens.shape
    angles = torch.arange(s, dtype=torch.float64)[:, None] / 10000 ** (
        torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(x):  # [b, h, s, d]
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def rms_norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight

    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    embedding = params["embedding.word_embeddings.weight"]
    h = embedding[tokens]
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        x = rms_norm(h, params[p + "input_layernorm.weight"])
        qkv = x @ params[p + "self_attention.linear_qkv.weight"].T
        qkv = qkv.view(b, s, GROUPS, q_per_group + 2, head_dim)  # per group: its q heads, k, v
        q = qkv[:, :, :, :q_per_group].reshape(b, s, HEADS, head_dim).transpose(1, 2)
        k = qkv[:, :, :, q_per_group].transpose(1, 2).repeat_interleave(q_per_group, 1)
        v = qkv[:, :, :, q_per_group + 1].transpose(1, 2).repeat_interleave(q_per_group, 1)
        scores = (rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(head_dim)).masked_fill(causal, -math.inf)
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, HIDDEN)
        h = h + attn @ params[p + "self_attention.linear_proj.weight"].T
        x = rms_norm(h, params[p + "pre_mlp_layernorm.weight"])
        gate, up = (x @ params[p + "mlp.linear_fc1.weight"].T).chunk(2, -1)
        h = h + (F.silu(gate) * up) @ params[p + "mlp.linear_fc2.weight"].T
    return rms_norm(h, params["decoder.final_layernorm.weight"]) @ params["output_layer.weight"].T


def _gpt_tp1_vs_fp64(rank, world_size):
    from megatron.core import parallel_state

    megatron_patches.apply_all(device="cpu")
    init_parallel()
    try:
        model = tiny_gpt(tiny_config())
        tokens, positions, labels = batch()
        logits, loss, grads = run_gpt(model, tokens, positions, labels)
        params = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
        ref_logits = _reference_logits(params, tokens)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), reduction="none")
        ref_loss = ref_loss.view(BATCH, SEQ)
        ref_loss.sum().backward()
        torch.testing.assert_close(logits.double(), ref_logits.detach(), **FP64_TOL)
        torch.testing.assert_close(loss.double(), ref_loss.detach(), **FP64_TOL)
        assert grads.keys() == params.keys()
        for name, grad in grads.items():
            assert torch.isfinite(grad).all(), name
            torch.testing.assert_close(grad.double(), params[name].grad, **FP64_TOL,
                                       msg=lambda m: f"{name}: {m}")
        return loss.sum().item()
    finally:
        parallel_state.destroy_model_parallel()


def test_tiny_gpt_tp1_matches_fp64_reference():
    losses = run_distributed(2, _gpt_tp1_vs_fp64)
    assert all(math.isfinite(x) and x > 0 for x in losses)


def _gpt_tp2_sp_vs_tp1(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    megatron_patches.apply_all(device="cpu")
    tokens, positions, labels = batch()
    init_parallel()
    try:
        model = tiny_gpt(tiny_config())
        full_params = {n: p.detach().clone() for n, p in model.named_parameters()}
        tp1_logits, tp1_loss, tp1_grads = run_gpt(model, tokens, positions, labels)
    finally:
        parallel_state.destroy_model_parallel()
    init_parallel(tensor_model_parallel_size=2)
    try:
        config = tiny_config(tensor_model_parallel_size=2, sequence_parallel=True)
        model = tiny_gpt(config)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(tp_shard(name, full_params[name], tp_rank, 2))
        cuda_current_device = torch.cuda.current_device
        logits, loss, _ = run_gpt(model, tokens, positions, labels)
        assert torch.cuda.current_device is cuda_current_device, "the CPU redirection must end with the call"
        # What finalize_model_grads does in training: sum the sequence-parallel norm grads over TP.
        model.ddp_config = DistributedDataParallelConfig()
        _allreduce_non_tensor_model_parallel_grads([model], config)
        sequence_parallel_params = sorted(
            n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False))
        torch.testing.assert_close(logits, tp1_logits, **TP_TOL)
        torch.testing.assert_close(loss, tp1_loss, **TP_TOL)
        for name, param in model.named_parameters():
            expected = tp_shard(name, tp1_grads[name], tp_rank, 2)
            torch.testing.assert_close(param.grad, expected, **TP_TOL, msg=lambda m: f"{name}: {m}")
        return sequence_parallel_params
    finally:
        parallel_state.destroy_model_parallel()


def test_tiny_gpt_tp2_sequence_parallel_matches_tp1_logits_and_grads():
    marked = run_distributed(2, _gpt_tp2_sp_vs_tp1)
    norms = [f"decoder.layers.{i}.{n}.weight"
             for i in range(LAYERS) for n in ("input_layernorm", "pre_mlp_layernorm")]
    assert marked[0] == marked[1] == sorted(norms + ["decoder.final_layernorm.weight"])


def _gpt_recompute_with_dropout(rank, world_size):
    from megatron.core import parallel_state, tensor_parallel

    megatron_patches.apply_all(device="cpu")
    tokens, positions, labels = batch()
    init_parallel()
    try:
        dropout = dict(hidden_dropout=0.2, attention_dropout=0.2)
        plain = tiny_gpt(tiny_config(**dropout))
        recomputed = tiny_gpt(tiny_config(**dropout, recompute_granularity="full",
                                            recompute_method="uniform", recompute_num_layers=1))
        recomputed.load_state_dict(plain.state_dict())
        runs = {}
        for name, model, seed in (("plain", plain, 7), ("again", plain, 7), ("recomputed", recomputed, 7),
                                  ("other_seed", plain, 8)):
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
            model.zero_grad(set_to_none=True)
            loss = model(tokens, positions, None, labels=labels)
            loss.sum().backward()
            runs[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        for name in ("again", "recomputed"):
            torch.testing.assert_close(runs[name][0], runs["plain"][0], atol=0, rtol=0)
            for param, grad in runs[name][1].items():
                torch.testing.assert_close(grad, runs["plain"][1][param], atol=0, rtol=0)
        # dropout is really on: another seed gives another loss
        assert (runs["other_seed"][0] - runs["plain"][0]).abs().max() > 1e-3
    finally:
        parallel_state.destroy_model_parallel()


def test_dropout_is_deterministic_and_recompute_replays_it_on_cpu():
    run_distributed(2, _gpt_recompute_with_dropout)


def _rng_tracker_forks(rank, world_size):
    from megatron.core import tensor_parallel

    megatron_patches.apply_all(device="cpu")
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    default_after_seed = torch.get_rng_state()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():
        first = torch.rand(5)
    with tracker.fork():
        second = torch.rand(5)
    assert torch.equal(torch.get_rng_state(), default_after_seed), "fork must restore the default generator"
    # Megatron's tensor-model-parallel state is seeded with seed + 2718 + tp_rank.
    expected = torch.rand(10, generator=torch.Generator().manual_seed(123 + 2718))
    assert torch.equal(torch.cat([first, second]), expected)
    # The default (data-parallel) state is seeded with the seed itself, as on a GPU.
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(123)))
    with pytest.raises(ValueError, match="name='no-such-state'"):
        with tracker.fork("no-such-state"):
            pass


def test_rng_tracker_forks_the_cpu_generator():
    run_distributed(2, _rng_tracker_forks)


def _applied_twice(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer

    megatron_patches.apply_all(device="cpu")
    targets = (
        lambda: parallel_state.destroy_model_parallel,
        lambda: TransformerLayer.__dict__["__init__"],
        lambda: WrappedTorchNorm.__dict__["__new__"],
        lambda: transformer_utils.get_default_causal_mask,
        lambda: tp_random.CudaRNGStatesTracker.__dict__["fork"],
    )
    before = [target() for target in targets]
    assert megatron_patches.apply_all(device="cpu") == {name: [] for name in megatron_patches.PATCHES}
    for name, apply in megatron_patches.PATCHES.items():
        assert (apply("cpu") if name in megatron_patches.CPU_PATCHES else apply()) == [], name
    assert [target() for target in targets] == before


def test_each_patch_applied_twice_is_the_same_as_once():
    run_distributed(2, _applied_twice)


def test_run_device_decides_whether_the_cpu_patches_apply():
    assert megatron_patches.runs_on_cpu("cpu") and megatron_patches.runs_on_cpu(torch.device("cpu"))
    assert not megatron_patches.runs_on_cpu("cuda") and not megatron_patches.runs_on_cpu("cuda:0")
    assert megatron_patches.runs_on_cpu(None) == (not torch.cuda.is_available())
    with pytest.raises(ValueError, match=r"device='gpu' is not a torch device; pass 'cpu', 'cuda' or None"):
        megatron_patches.runs_on_cpu("gpu")
    # A CUDA run leaves megatron-core's CUDA code alone, also on a machine without CUDA.
    for apply in megatron_patches.CPU_PATCHES.values():
        assert apply("cuda") == []


def _probes(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_patches._patching import original_of
    from megatron_patches.cpu_shims import _leaves_the_cpu, _rng_tracker_keeps_cuda_states
    from megatron_patches.hcp_groups import destroy_leaves_hcp_groups
    from megatron_patches.torch_norm_sequence_parallel import _sequence_parallel_config

    megatron_patches.apply_all(device="cpu")
    assert destroy_leaves_hcp_groups(original_of(parallel_state, "destroy_model_parallel"))
    with pytest.raises(AssertionError, match="sequence parallel"):
        original_of(WrappedTorchNorm, "__new__")(WrappedTorchNorm, _sequence_parallel_config(), 8)
    norm = WrappedTorchNorm(_sequence_parallel_config(), 8)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel
    # The original mask fails without CUDA and lands on the GPU with it; the patched one stays on the CPU.
    assert _leaves_the_cpu(lambda: original_of(transformer_utils, "get_default_causal_mask")(2))
    assert not _leaves_the_cpu(lambda: transformer_utils.get_default_causal_mask(2))
    assert not _rng_tracker_keeps_cuda_states(), "the patched RNG tracker must keep CPU generator states"


def test_probes_see_the_upstream_problems_in_the_kept_originals():
    run_distributed(2, _probes)


def _cpu_masks(rank, world_size):
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    megatron_patches.apply_all(device="cpu")
    i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    assert fused_softmax.get_default_causal_mask is transformer_utils.get_default_causal_mask
    assert torch.equal(fused_softmax.get_default_causal_mask(5), j > i)
    # sq=3 queries aligned to the last of skv=5 keys; window (2 before, 0 after)
    qi, kj = torch.arange(3)[:, None] + 2, torch.arange(5)[None, :]
    expected = ~((kj >= qi - 2) & (kj <= qi))
    assert torch.equal(fused_softmax.get_sliding_window_causal_mask(3, 5, (2, 0)), expected)


def test_causal_masks_are_built_on_cpu_and_match_the_definition():
    run_distributed(2, _cpu_masks)


def _rope_on_cp_rank(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    megatron_patches.apply_all(device="cpu")
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    try:
        cp_group = parallel_state.get_context_parallel_group()
        cp_rank, cp_size, head_dim, seq = cp_group.rank(), cp_group.size(), 8, 32
        rope = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, use_cpu_initialization=True,
                               cp_group=cp_group)
        local = rope(seq)
        chunk = seq // (2 * cp_size)
        my_chunks = (cp_rank, 2 * cp_size - 1 - cp_rank)
        positions = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in my_chunks])
        angles = positions[:, None].double() / 10000 ** (torch.arange(0, head_dim, 2).double() / head_dim)
        expected = torch.cat([angles, angles], -1)[:, None, None, :]
        torch.testing.assert_close(local.double(), expected, atol=1e-5, rtol=1e-6)
        direct = rope_utils.get_pos_emb_on_this_cp_rank(rope.get_emb(seq), 0, cp_group)
        assert torch.equal(direct, local)
        with pytest.raises(ValueError, match="cp_group=None"):
            rope_utils.get_pos_emb_on_this_cp_rank(local, 0, None)
        with pytest.raises(ValueError, match="pad the sequence to a multiple of 8"):
            rope_utils.get_pos_emb_on_this_cp_rank(rope.get_emb(seq + 2), 0, cp_group)
    finally:
        parallel_state.destroy_model_parallel()


def _hcp_groups_across_reinit(rank, world_size):
    from megatron.core import parallel_state

    megatron_patches.apply_all(device="cpu")

    def hcp_ranks():
        groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
        return None if groups is None else [dist.get_process_group_ranks(g) for g in groups]

    seen = []
    for sizes in ([2, 2], [4], None):
        parallel_state.initialize_model_parallel(context_parallel_size=4,
                                                 hierarchical_context_parallel_sizes=sizes)
        seen.append(hcp_ranks())
        parallel_state.destroy_model_parallel()
        seen.append(hcp_ranks())
    return seen


def test_rope_slice_on_each_cp_rank_matches_hand_computed_positions():
    run_distributed(4, _rope_on_cp_rank)


def test_destroy_model_parallel_forgets_hierarchical_cp_groups():
    for rank, seen in enumerate(run_distributed(4, _hcp_groups_across_reinit)):
        inner = [rank - rank % 2, rank - rank % 2 + 1]  # level 0: adjacent pairs
        outer = [rank % 2, rank % 2 + 2]  # level 1: same position in each pair
        # init [2,2], destroy, init [4], destroy, init without HCP (must not see the [4] groups), destroy
        assert seen == [[inner, outer], None, [[0, 1, 2, 3]], None, None, None], rank


def test_per_layer_cp_comm_type_gives_each_layer_its_own_type():
    from megatron_patches.per_layer_cp_comm_type import cp_comm_types_received

    megatron_patches.apply_per_layer_cp_comm_type_fix()  # no CPU shim: safe in the test runner's process
    types = ["p2p", "a2a", "all_gather", "a2a+p2p"]
    assert cp_comm_types_received(types) == types


class _RecordCpCommType(torch.nn.Module):
    def __init__(self, config, layer_number, cp_comm_type=None, **kwargs):
        super().__init__()
        self.cp_comm_type = cp_comm_type


def _cp_comm_type_per_pipeline_stage(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    megatron_patches.apply_all(device="cpu")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        types = ["p2p", "a2a", "all_gather", "a2a+p2p"]
        config = tiny_config(num_layers=4, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                              context_parallel_size=2, cp_comm_type=types)
        layer = ModuleSpec(module=TransformerLayer,
                           submodules=TransformerLayerSubmodules(self_attention=_RecordCpCommType))
        block = TransformerBlock(config, layer, post_layer_norm=False)
        assert config.cp_comm_type is types, "the config must hold the user's list again"
        return [(layer.layer_number, layer.self_attention.cp_comm_type) for layer in block.layers]
    finally:
        parallel_state.destroy_model_parallel()


def test_per_layer_cp_comm_type_uses_global_layer_numbers_across_pipeline_stages():
    stage0, stage1 = run_distributed(2, _cp_comm_type_per_pipeline_stage)
    assert stage0 == [(1, "p2p"), (2, "a2a")]
    assert stage1 == [(3, "all_gather"), (4, "a2a+p2p")]


def test_expert_bias_patch_writes_the_one_in_place_add_out_of_place():
    """megatron-core 0.16.1's expert MLP adds its bias in place; the patched method is the same source with that
    statement out of place (and nothing else), and an expert with a bias and per-token scales now backpropagates
    at one tensor-parallel rank (the converted gpt-oss trains: tests/test_convert_train.py)."""
    import dis
    import inspect

    from megatron.core.transformer import mlp

    from megatron_patches._patching import original_of
    from megatron_patches.expert_bias_in_place import IN_PLACE, OUT_OF_PLACE, apply_expert_bias_out_of_place

    original = inspect.getsource(original_of(mlp.MLP, "forward"))
    assert IN_PLACE in original
    apply_expert_bias_out_of_place()
    assert apply_expert_bias_out_of_place() == []  # idempotent
    patched = mlp.MLP.forward
    assert patched is not original_of(mlp.MLP, "forward")
    assert patched.__code__.co_firstlineno == original_of(mlp.MLP, "forward").__code__.co_firstlineno

    def in_place_adds(fn):
        return sum(i.argrepr == "+=" for i in dis.get_instructions(fn))

    assert in_place_adds(patched) == in_place_adds(original_of(mlp.MLP, "forward")) - 1  # that one statement
    assert OUT_OF_PLACE not in original
