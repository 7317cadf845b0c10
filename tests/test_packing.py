"""K and V as one packed tensor (``algorithms/packing.py``): a K and V that already are the column ranges of
one buffer are recognised as it (no second packing, no concatenation of a packed gradient), anything else
is not; the schemes that move K/V move them packed, one collective for both."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mcp_context.algorithms.packing import _Split, pack_kv, packed, packed_columns, split_kv, unpacked
from tests._dist import run_distributed
from tests.reference import relative_error

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _buffer(*shape, dtype=torch.float32, device="cpu"):
    return torch.arange(torch.Size(shape).numel(), dtype=dtype, device=device).reshape(shape)


@pytest.mark.parametrize("dqk,dv", [(4, 4), (6, 2)])  # MLA: value and key head dims differ
def test_the_columns_of_one_buffer_are_that_buffer(dqk, dv):
    buf = _buffer(5, 1, 3, dqk + dv)
    k, v = split_kv(buf, dqk)
    got = packed_columns(k, v)
    assert got is not None and got.data_ptr() == buf.data_ptr() and torch.equal(got, buf)
    kb, vb = (x.permute(1, 2, 0, 3) for x in (k, v))  # the kernels' [b, h, n, d] views
    assert pack_kv(kb, vb).data_ptr() == buf.data_ptr()  # a message needs no copy


def test_anything_else_is_not_a_packed_buffer():
    buf = _buffer(5, 1, 3, 8)
    k, v = split_kv(buf, 4)
    assert packed_columns(k.clone(), v.clone()) is None  # separate tensors
    assert packed_columns(v, k) is None  # the wrong order
    assert packed_columns(k, v.to(torch.float64)) is None
    wide = _buffer(5, 1, 3, 10)  # columns of a buffer with more columns than K's and V's
    assert packed_columns(wide.narrow(-1, 0, 4), wide.narrow(-1, 4, 4)) is None
    rows = _buffer(10, 1, 3, 8).narrow(0, 0, 5)  # some rows of a buffer: still one packed tensor
    assert packed_columns(*split_kv(rows, 4)).data_ptr() == rows.data_ptr()
    kb, vb = (x.permute(1, 2, 0, 3) for x in (k.clone(), v.clone()))
    message = pack_kv(kb, vb)
    assert torch.equal(message, buf) and message.data_ptr() != buf.data_ptr()  # one concatenation


def test_fake_cuda_tensors_are_recognised_too():
    """The rehearsal counts what a GPU would do: a packed buffer of fake CUDA tensors is found as on CPU."""
    with FakeTensorMode():
        buf = torch.empty(5, 1, 3, 8, device="cuda")
        k, v = split_kv(buf, 4)
        assert packed_columns(k, v) is not None and packed_columns(k.clone(), v) is None


def test_a_packed_gradient_is_handed_on_as_it_is_and_anything_else_concatenated_once():
    grad = _buffer(5, 1, 3, 8)
    same, _ = _Split.backward(None, *split_kv(grad, 4))
    assert same.data_ptr() == grad.data_ptr()
    dk, dv = (x.clone() for x in split_kv(grad, 4))
    joined, _ = _Split.backward(None, dk, dv)
    assert torch.equal(joined, grad) and joined.data_ptr() != grad.data_ptr()


def test_packed_and_unpacked_are_differentiable_and_exact():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(5, 1, 3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(5, 1, 3, 2, dtype=torch.float64, generator=g, requires_grad=True)
    k2, v2 = unpacked(packed(k, v) * 2, 6)
    (k2.sum() * 3 + v2.pow(2).sum()).backward()
    assert torch.equal(k.grad, torch.full_like(k, 6.0)) and torch.equal(v.grad, 8 * v.detach())


def _collective_calls(rank, world, comm, sizes):
    from mcp_context import build_hcp_groups, comm_stats, context_parallel_attention

    groups = build_hcp_groups(sizes)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(16, 1, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(16, 1, 2, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    comm_stats.reset()
    context_parallel_attention(q, k, v, groups, comm=comm, layout="zigzag").sum().backward()
    return dict(comm_stats.snapshot()[2])


@pytest.mark.parametrize("comm,sizes,want", [
    ("a2a", [2], {"all_to_all": 6}),  # q, kv, out; dout, dq, dkv
    ("all_gather", [2], {"all_gather": 1, "reduce_scatter": 1}),
    ("a2a+all_gather", [2, 2], {"all_to_all": 6, "all_gather": 1, "reduce_scatter": 1}),
])
def test_kv_move_as_one_tensor_one_collective_for_both(comm, sizes, want):
    """K and V, and their gradients, cross each collective once together: an all-to-all each way per
    tensor moved (q, the packed K/V, the output), one all-gather and one reduce-scatter."""
    world = 1
    for s in sizes:
        world *= s
    for rank, calls in enumerate(run_distributed(world, _collective_calls, comm, sizes)):
        assert {op: calls.get(op, 0) for op in want} == want, (rank, calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuDNN's fused op)")
@pytest.mark.parametrize("comm", ["all_gather", "a2a+all_gather", "a2a"])
def test_on_cuda_packed_kv_into_cudnn_gives_what_separate_kv_give(comm):
    """The K/V a collective delivers are column views of one packed tensor (head stride dqk + dv, not dqk):
    cuDNN reads them so, forward and backward. A member's out, dq, dk and dv equal those of the same member
    fed separate contiguous K and V (what the engine handed cuDNN before, run on an H200) within
    1e-2 x max(1, |g|) (equal unless cuDNN picks another kernel for the other strides; the CPU op gives them
    bit for bit). Passes on an H200 (2026-11-26)."""
    from mcp_context.algorithms.executor import RingAttention
    from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel
    from mcp_context.masks import CAUSAL
    from tools.rank_step import rank_step

    step = rank_step(comm, 8, 8192, CAUSAL, TorchKernel(FUSED_OPS["cudnn"]), 32, 8, 128, rank=3)
    assert step.packed_kv
    g = torch.Generator(device="cuda").manual_seed(3)
    q, dout = (torch.randn(step.q_rows, 1, step.heads, 128, device="cuda", generator=g, dtype=torch.bfloat16)
               for _ in range(2))
    kv = torch.randn(step.kv_rows, 1, step.kv_heads, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    runs = []
    for packed_input in (True, False):
        ql, kvl = (x.detach().clone().requires_grad_() for x in (q, kv))
        k, v = unpacked(kvl, 128) if packed_input else (x.contiguous() for x in split_kv(kvl, 128))
        out, _ = RingAttention.apply(ql, k, v, step.plan)
        out.backward(dout)
        runs.append((out.detach(), ql.grad, kvl.grad))
    for name, a, b in zip(("out", "dq", "dkv"), *runs):
        err = relative_error(a, b)
        assert err <= 1e-2, (name, err)
