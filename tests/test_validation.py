"""Every input the engine cannot serve is refused with a message naming the value and the fix.

Each case has exactly one defect: the engine checks its configuration (comm, layout, groups, mask,
scale) when it is built and the shards when it is called, so a call with two defects reports the
configuration's first."""
import re

import torch

from tests._dist import run_distributed

CASES = {
    "sizes_product": r"hierarchical_context_parallel_sizes=\[3, 3\] multiply to 9, but context_parallel_size=4; "
                     r"choose sizes whose product is 4, e.g. \[2, 2\]",
    "sizes_type": r"hierarchical_context_parallel_sizes=\[2, 0\] must be a non-empty list of positive integers",
    "heads_a2a": r"query heads h=6 is not divisible by the all-to-all degree=4 \(comm='a2a'\); use a degree that "
                 r"divides 6, or comm='p2p'",
    "kv_heads_a2a": r"key/value heads h_kv=3 cannot be replicated evenly over the all-to-all degree=4",
    "seq_len": r"sequence length 12 is not divisible by 2\*cp=8 for layout 'zigzag'; pad to 16",
    "comm": r"comm='ring' is not a known cp_comm_type; choose one of p2p, a2a, all_gather, a2a\+p2p",
    "layout": r"layout='zig' is not known; choose one of contiguous, zigzag, striped",
    "a2a+p2p_flat": r"comm='a2a\+p2p' needs hierarchical_context_parallel_sizes with at least 2 levels "
                    r"\(got \[4\]\); build them with build_hcp_groups",
    "shape": r"q \(3, 2, 8, 4\) and k \(3, 2, 8, 8\) must agree in s_local, batch and head_dim",
    "kv_shape": r"k and v must agree in s_local, batch and heads",
    "gqa": r"query heads h=8 are not a multiple of key/value heads h_kv=3",
    "dtype": r"q, k, v must share one dtype, got torch.float32, torch.float64, torch.float32; cast them first",
    "device": r"q, k, v must be on one device, got cpu, meta, cpu",
    "rank4": r"q must be \[s_local, b, heads, head_dim\] \(sbhd\), got shape \(2, 8, 4\)",
    "empty": r"q has an empty dimension, shape \(0, 2, 8, 4\): every CP rank needs at least one token",
    "scale_negative": r"softmax_scale=-0.5 must be a positive finite number .*pass None for the default",
    "scale_nan": r"softmax_scale=nan must be a positive finite number",
    "backend": r"backend='cudnn' is not known; choose one of auto, math, torch, torch:cpu_flash, torch:cudnn",
    "named_op": r"backend='torch:flash' does not serve torch.float32 on cpu here: runs on cuda only",
}


def _errors(rank, world):
    from mcp_context import build_hcp_groups, context_parallel_attention

    flat = build_hcp_groups([4])

    def t(s=4, h=8, d=4, dtype=torch.float32, device="cpu"):
        return torch.zeros(s, 2, h, d, dtype=dtype, device=device)

    calls = {
        "sizes_product": lambda: build_hcp_groups([3, 3]),
        "sizes_type": lambda: build_hcp_groups([2, 0]),
        "heads_a2a": lambda: context_parallel_attention(t(h=6), t(h=6), t(h=6), flat, comm="a2a"),
        "kv_heads_a2a": lambda: context_parallel_attention(t(h=12), t(h=3), t(h=3), flat, comm="a2a"),
        "seq_len": lambda: context_parallel_attention(t(s=3), t(s=3), t(s=3), flat, comm="p2p"),
        "comm": lambda: context_parallel_attention(t(), t(), t(), flat, comm="ring"),
        "layout": lambda: context_parallel_attention(t(), t(), t(), flat, layout="zig"),
        "a2a+p2p_flat": lambda: context_parallel_attention(t(), t(), t(), flat, comm="a2a+p2p"),
        "shape": lambda: context_parallel_attention(t(s=3), t(s=3, d=8), t(s=3, d=8), flat, comm="p2p"),
        "kv_shape": lambda: context_parallel_attention(t(), t(), t(h=4), flat, comm="p2p"),
        "gqa": lambda: context_parallel_attention(t(), t(h=3), t(h=3), flat, comm="p2p"),
        "dtype": lambda: context_parallel_attention(t(), t(dtype=torch.float64), t(), flat, comm="p2p"),
        "device": lambda: context_parallel_attention(t(), t(device="meta"), t(), flat, comm="p2p"),
        "rank4": lambda: context_parallel_attention(t()[0], t(), t(), flat, comm="p2p"),
        "empty": lambda: context_parallel_attention(t(s=0), t(s=0), t(s=0), flat, comm="p2p"),
        "scale_negative": lambda: context_parallel_attention(t(), t(), t(), flat, comm="p2p", softmax_scale=-0.5),
        "scale_nan": lambda: context_parallel_attention(t(), t(), t(), flat, comm="p2p", softmax_scale=float("nan")),
        "backend": lambda: context_parallel_attention(t(), t(), t(), flat, comm="p2p", backend="cudnn"),
        "named_op": lambda: context_parallel_attention(t(), t(), t(), flat, comm="p2p", backend="torch:flash"),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = None
        except ValueError as err:
            messages[name] = str(err)
    try:
        context_parallel_attention(t(), t(), t(), flat, comm="p2p", causal="False")
        messages["causal"] = None
    except TypeError as err:
        messages["causal"] = str(err)
    return messages


def test_each_bad_input_is_refused_with_a_message_that_names_the_fix():
    messages = run_distributed(4, _errors)[0]
    for name, pattern in CASES.items():
        assert messages[name] is not None, f"{name}: no error raised"
        assert re.search(pattern, messages[name]), (name, messages[name])
    assert messages["causal"] == "causal='False' must be a bool (True for causal attention, False for full), not str"


def _disagreeing(rank, world, what):
    from mcp_context import build_hcp_groups, context_parallel_attention

    s = 4 if rank != 1 or what != "shape" else 6
    dtype = torch.float64 if rank == 1 and what == "dtype" else torch.float32
    causal = not (rank == 1 and what == "config")
    q = torch.zeros(s, 2, 8, 4, dtype=dtype)
    try:
        context_parallel_attention(q, q, q, build_hcp_groups([world]), comm="p2p", causal=causal)
    except ValueError as err:
        return str(err)
    return None


def test_ranks_that_disagree_on_shape_dtype_or_config_all_raise_the_same_error():
    """Before any collective, the CP ranks compare shapes, dtypes and configuration: every rank raises
    the same error naming each rank's inputs (no abort inside gloo, no rank returning a result)."""
    for what, detail in (("shape", r"CP rank 1: q \[6, 2, 8, 4\] float32"), ("dtype", r"CP rank 1: q \[4, 2, 8, 4\] "
                                                                                     r"float64"),
                         ("config", r"CP rank 1: q \[4, 2, 8, 4\] float32, .* \(configuration differs\)")):
        errors = run_distributed(4, _disagreeing, what)
        assert errors[0] is not None and all(e == errors[0] for e in errors), (what, errors)
        assert errors[0].startswith("CP ranks disagree on the attention inputs") and re.search(detail, errors[0])


def test_allgather_is_an_alias_of_all_gather():
    from mcp_context import normalize_comm

    assert normalize_comm("allgather") == "all_gather"


def _strided(rank, world, comm):
    from mcp_context import context_parallel_attention, shard_sequence
    from tests.reference import full_attention, random_qkv

    q, k, v, dout = random_qkv(8 * world, 2, 4, 2, 8, seed=5)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, _ = full_attention(*ref, True, 8 ** -0.5)
    ref_out.backward(dout)
    # Shards whose last dimension is strided (a transposed copy viewed back): the fused CPU op misread them.
    local = [shard_sequence(x, world, rank).transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
             for x in (q, k, v)]
    assert all(x.stride(-1) != 1 for x in local)
    out = context_parallel_attention(*local, None, comm=comm, layout="zigzag")
    out.backward(shard_sequence(dout, world, rank))
    pairs = [(out, ref_out)] + [(x.grad, r.grad) for x, r in zip(local, ref)]
    return max((a - shard_sequence(b.detach(), world, rank)).abs().max().item() for a, b in pairs)


def test_shards_with_a_strided_last_dimension_are_exact():
    for comm in ("p2p", "all_gather"):
        assert max(run_distributed(2, _strided, comm)) <= 1e-10, comm
