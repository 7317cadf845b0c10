"""``comm="a2a+all_gather"``: all-to-all on level 0, K/V all-gathered over the outer levels (Llama 3's
all-gather CP with Ulysses inside), against the fp64 reference and the analytic byte count.

Every layout x causal/full x window x packed x GQA/MQA (KV replication included) x [2,2], [2,2,2],
[2,4]; fp64 <= 1e-10 and fp32 <= 1e-5 on out, lse, dq, dk, dv. Axes beyond layout x hierarchy are
cycled, as in test_window. The bytes each rank sends equal the level-0 all-to-all plus an all-gather
of K/V over the ``P / P0`` outer members and the reduce-scatter of dK/dV.
"""
from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from tests._dist import hcp_groups, run_distributed
from tests.reference import TOL, document_ids, full_attention, in_both_dtypes, random_qkv, shard_errors
from tests.test_packed import packing

HIERARCHIES = [(4, [2, 2]), (8, [2, 2, 2]), (8, [2, 4])]
LAYOUTS = ["zigzag", "contiguous", "striped", "packed-zigzag", "packed-balanced"]
MASKS = [(True, None), (False, None), (True, (5, 0)), (False, (3, 6))]  # (causal, window)


def _cases():
    masks, kvs = itertools.cycle(range(len(MASKS))), itertools.cycle([2, 8, 1, 4])
    for world, sizes in HIERARCHIES:
        for layout in LAYOUTS:
            m, kv = next(masks), next(kvs)
            yield pytest.param(world, sizes, layout, m, kv, id=f"w{world}-{sizes}-{layout}-mask{m}-hkv{kv}"
                               .replace(" ", ""))


def _compare(rank, world, sizes, layout, m, kv_heads, dtype):
    from mcp_context import context_parallel_attention, shard_sequence

    causal, window = MASKS[m]
    packed = layout.startswith("packed-")
    layout = layout.removeprefix("packed-")
    docs, ids, seq_len = {}, None, 12 * world
    if packed:
        cu, padded, seq_len = packing(world, layout)
        docs = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32), "cu_seqlens_padded": torch.tensor(padded,
                                                                                                   dtype=torch.int32)}
        ids = document_ids(seq_len, cu, padded)
    q, k, v, dout = random_qkv(seq_len, 1 if packed else 2, 8, kv_heads, 8, seed=world + m)
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = full_attention(*ref_inputs, causal, 1 / math.sqrt(8), window=window or (-1, -1),
                                      documents=ids)
    ref_out.backward(dout)

    def shard(x):
        return shard_sequence(x, world, rank, layout, 0, docs.get("cu_seqlens"), docs.get("cu_seqlens_padded"))

    local = [shard(x).to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = context_parallel_attention(*local, hcp_groups(sizes), causal=causal, layout=layout,
                                          comm="a2a+all_gather", return_lse=True, window_size=window, **docs)
    out.backward(shard(dout).to(dtype))
    rows = shard(ids) >= 0 if packed else torch.ones(out.shape[:3], dtype=torch.bool)
    errors = shard_errors(shard, out, lse, local, ref_out, ref_lse, ref_inputs, rows)
    return errors


@pytest.mark.parametrize("world,sizes,layout,m,kv_heads", list(_cases()))
def test_a2a_all_gather_matches_fp64_reference(world, sizes, layout, m, kv_heads):
    for rank, results in enumerate(run_distributed(world, functools.partial(in_both_dtypes, _compare), sizes,
                                                   layout, m, kv_heads)):
        for dtype, errors in results.items():
            for name, err in errors.items():
                assert err <= TOL[dtype], f"rank {rank} {dtype} {name}: max abs error {err:.3e} > {TOL[dtype]}"


def test_the_matrix_covers_every_mask_and_head_ratio():
    values = [p.values for p in _cases()]
    assert {v[3] for v in values} == set(range(len(MASKS))) and {v[4] for v in values} == {1, 2, 4, 8}
    assert {(v[0], v[2]) for v in values} == {(w, lay) for w, _ in HIERARCHIES for lay in LAYOUTS}


N, B, H, D = 8, 2, 8, 4


def _count(rank, world, sizes, h_kv):
    from mcp_context import comm_stats, context_parallel_attention

    groups = hcp_groups(sizes)
    q, k, v = (torch.randn(N, B, h, D, dtype=torch.float64, requires_grad=True) for h in (H, h_kv, h_kv))
    comm_stats.reset()
    context_parallel_attention(q, k, v, groups, comm="a2a+all_gather", layout="zigzag").sum().backward()
    return dict(comm_stats.bytes_sent)


@pytest.mark.parametrize("sizes", [[2, 2], [2, 4], [2, 2, 2]])
@pytest.mark.parametrize("h_kv", [8, 1])
def test_counted_bytes_equal_the_analytic_all_gather_volume(sizes, h_kv):
    """Per rank: the level-0 all-to-all of q, k, v, out (and their gradients) over ``P0`` ranks, then
    ``R - 1`` copies of this rank's K/V block (``P0*N`` tokens, ``max(h_kv, P0)/P0`` heads) gathered
    and as many dK/dV blocks reduce-scattered, ``R = P / P0`` (fp64: 8 bytes)."""
    inner, world = sizes[0], math.prod(sizes)
    ring, es = world // inner, 8
    kv = max(h_kv, inner)
    block = inner * N * B * (kv // inner) * D * es
    expected = {"all_to_all": 2 * (inner - 1) * N * B * D * es * (2 * H + 2 * kv) // inner,
                "all_gather": 2 * (ring - 1) * block, "reduce_scatter": 2 * (ring - 1) * block}
    for rank, counted in enumerate(run_distributed(world, _count, sizes, h_kv)):
        assert counted == expected, f"rank {rank}"
