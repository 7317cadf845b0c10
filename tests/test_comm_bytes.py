"""Bytes counted by the comm layer for one forward+backward equal each scheme's analytic figure.

P=4, local length n, batch b, h=8 query heads, h_kv key/value heads, head dim d, fp64 (8 bytes; the
gradient accumulators that travel the ring are fp64 too). With ``blk = n*b*h_kv*d``:
- p2p: K and V go P-1 hops forward and again in backward, dK/dV make P hops home:
  ``2*(P-1)*2*blk*8 + P*2*blk*8``.
- a2a: q, k, v, out forward and dout, dq, dk, dv backward each send (P-1)/P of their shard
  (k, v with h_kv replicated up to P heads when h_kv < P).
- all_gather: K and V gathered ((P-1) shards sent each), reduce-scattered in backward.
- a2a+p2p [2, 2]: the sum of its levels (an all-to-all of 2, then a p2p ring of 2 over 2n tokens).
"""
import pytest
import torch

from tests._dist import run_distributed

P, N, B, H, D = 4, 8, 2, 8, 4


def _expected(comm, h_kv):
    es = 8
    if comm == "p2p":
        blk = N * B * h_kv * D
        return {"ring_kv": 2 * (P - 1) * 2 * blk * es, "ring_dkv": P * 2 * blk * es}
    if comm == "a2a":
        kv = max(h_kv, P)
        return {"all_to_all": 2 * (P - 1) * N * B * D * es * (2 * H + 2 * kv) // P}
    if comm == "all_gather":
        shard = N * B * h_kv * D * es
        return {"all_gather": 2 * (P - 1) * shard, "reduce_scatter": 2 * (P - 1) * shard}
    inner, ring = 2, 2  # a2a+p2p over [2, 2]
    kv = max(h_kv, inner)
    blk = inner * N * B * (kv // inner) * D
    return {"all_to_all": 2 * (inner - 1) * N * B * D * es * (2 * H + 2 * kv) // inner,
            "ring_kv": 2 * (ring - 1) * 2 * blk * es, "ring_dkv": ring * 2 * blk * es}


def _count(rank, world, comm, h_kv):
    from mcp_context import build_hcp_groups, comm_stats, context_parallel_attention

    groups = build_hcp_groups([2, 2])
    q, k, v = (torch.randn(N, B, h, D, dtype=torch.float64, requires_grad=True) for h in (H, h_kv, h_kv))
    comm_stats.reset()
    context_parallel_attention(q, k, v, groups, comm=comm, layout="zigzag").sum().backward()
    return dict(comm_stats.bytes_sent)


@pytest.mark.parametrize("comm", ["p2p", "a2a", "all_gather", "a2a+p2p"])
@pytest.mark.parametrize("h_kv", [8, 2])
def test_counted_bytes_equal_the_analytic_figure(comm, h_kv):
    for rank, counted in enumerate(run_distributed(P, _count, comm, h_kv)):
        assert counted == _expected(comm, h_kv), f"rank {rank}"


def _destinations(rank, world):
    from mcp_context import build_hcp_groups, comm_stats, context_parallel_attention

    groups = build_hcp_groups([2, 2])
    q = torch.randn(N, B, H, D, dtype=torch.float64, requires_grad=True)
    comm_stats.reset()
    context_parallel_attention(q, q, q, groups, comm="a2a+p2p", layout="zigzag").sum().backward()
    _, bytes_to, calls = comm_stats.snapshot()
    return bytes_to, calls


def test_the_trace_names_every_destination_and_call():
    """a2a+p2p over [2, 2]: the all-to-all goes only to the level-0 partner, the ring only to the next
    group's rank with the same level-0 index (rank r sends to (r + 2) % 4); per destination the bytes add
    up to the per-operation figure, and each ring transfer is one call (1 + 1 K/V hops, 2 dK/dV hops); the
    all-to-all is one call per tensor each way (q, the packed K/V, the output; dout, dq, the packed dK/dV)."""
    for rank, (bytes_to, calls) in enumerate(run_distributed(P, _destinations)):
        expected = _expected("a2a+p2p", H)
        assert bytes_to["all_to_all"] == {rank ^ 1: expected["all_to_all"]}, rank
        assert bytes_to["ring_kv"] == {(rank + 2) % 4: expected["ring_kv"]}, rank
        assert bytes_to["ring_dkv"] == {(rank + 2) % 4: expected["ring_dkv"]}, rank
        assert calls["ring_kv"] == 2 and calls["ring_dkv"] == 2 and calls["all_to_all"] == 6, (rank, calls)
