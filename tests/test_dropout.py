"""Attention dropout: the kernel applies the mask it says it does, and the distributed engine's
gradients with dropout are the true derivatives of its (deterministic, seeded) output.

Kernel: against an explicit fp64 softmax with the same keep-mask, out and grads within 1e-12.
Engine: a directional derivative ``(f(x+eps*u) - f(x-eps*u)) / 2eps`` along a random global
direction ``u`` (each rank perturbs its shard) equals ``<grad, u>`` within 1e-6 relative (fp64).
"""
import math

import pytest
import torch

from mcp_context.kernels import Dropout, get_kernel
from mcp_context.masks import CAUSAL_BLOCK
from tests._dist import hcp_groups, run_distributed
from tests.reference import random_qkv


def test_math_kernel_dropout_matches_explicit_masked_softmax():
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, 10, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 10, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    drop = Dropout(0.3, seed=7)
    kernel = get_kernel("auto", torch.device("cpu"), torch.float64, dropout=True)
    out, lse = kernel.forward(q, k, v, CAUSAL_BLOCK, 0.3, drop)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    kr, vr = (x.repeat_interleave(2, 1) for x in leaves[1:])
    scores = (leaves[0] @ kr.transpose(-1, -2) * 0.3).masked_fill(torch.ones(10, 10).triu(1).bool(), -math.inf)
    keep = drop.keep_scaled(torch.Size([2, 2, 2, 10, 10]), q.device, torch.float64).reshape(2, 4, 10, 10)
    ref = (torch.softmax(scores, -1) * keep) @ vr
    ref.backward(dout)
    assert (out - ref).abs().max() < 1e-12 and (lse - torch.logsumexp(scores, -1)).abs().max() < 1e-12
    grads = kernel.backward(dout, q, k, v, ref.detach(), lse, CAUSAL_BLOCK, 0.3, drop)
    for got, leaf in zip(grads, leaves):
        assert (got - leaf.grad).abs().max() < 1e-12
    kept = (keep > 0).double().mean().item()
    assert abs(kept - 0.7) < 0.05  # the keep rate is 1 - p


def test_fused_backend_refuses_dropout():
    with pytest.raises(ValueError, match=r"backend='torch' cannot apply attention dropout inside the ring"):
        get_kernel("torch", torch.device("cpu"), torch.float32, dropout=True)


def _directional(rank, world, sizes, comm):
    from mcp_context import context_parallel_attention, shard_sequence

    groups = hcp_groups(sizes)
    q, k, v, dout = random_qkv(8 * world, 2, 4, 2, 8, seed=3)
    gen = torch.Generator().manual_seed(11)
    direction = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (q, k, v)]
    shard = lambda x: shard_sequence(x, world, rank, "zigzag")  # noqa: E731

    def f(eps, *inputs):
        xs = [shard(x + eps * u) for x, u in zip((q, k, v), direction)]
        if inputs:
            xs = inputs
        return context_parallel_attention(*xs, groups, comm=comm, dropout_p=0.25, dropout_seed=123)

    local = [shard(x).requires_grad_() for x in (q, k, v)]
    out = f(0.0, *local)
    out.backward(shard(dout))
    eps = 1e-5
    with torch.no_grad():
        numeric = ((f(eps) - f(-eps)) * shard(dout)).sum() / (2 * eps)
        analytic = sum((x.grad * shard(u)).sum() for x, u in zip(local, direction))
        again = f(0.0)
    sums = torch.stack([numeric, analytic])
    torch.distributed.all_reduce(sums)
    other_seed = context_parallel_attention(*[x.detach() for x in local], groups, comm=comm, dropout_p=0.25,
                                            dropout_seed=124)
    return sums.tolist(), torch.equal(again, out.detach()), torch.equal(other_seed, out.detach())


@pytest.mark.parametrize("world,sizes,comm", [(2, [2], "p2p"), (4, [2, 2], "a2a+p2p"), (4, [4], "all_gather")])
def test_dropout_gradients_are_the_derivative_of_the_seeded_output(world, sizes, comm):
    for (numeric, analytic), repeatable, same_for_other_seed in run_distributed(world, _directional, sizes, comm):
        assert abs(numeric - analytic) <= 1e-6 * abs(analytic), (numeric, analytic)
        assert repeatable and not same_for_other_seed
