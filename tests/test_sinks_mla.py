"""Attention sinks (gpt-oss, Megatron's ``softmax_type``) and MLA head dims (value head dim != query/key
head dim) through every scheme, layout and hierarchy, against an fp64 reference.

The reference (``tests.reference.full_attention`` with ``sink``) writes the sink as one more score
column with no value, sharing no code with the package's merge. Sinks: every comm x layout (packed
ones included) x [P], [2,2], [2,2,2], with GQA/MQA/KV replication, windows and packed documents
cycled. The sink gradient that comes back on each rank is that rank's share; the test sums the shares
over the CP ranks (as Megatron's gradient all-reduce does) and compares the sum. MLA (dqk=24, dv=16):
every comm x layout x depth, with and without a sink. Also the bad-input refusals.
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

HIERARCHIES = [(4, [4]), (4, [2, 2]), (8, [2, 2, 2])]  # [P], [2,2], [2,2,2] (P = 2 is test_engine_dist's)
LAYOUTS = ["zigzag", "contiguous", "striped", "packed-zigzag", "packed-balanced"]
HEADS, HEAD_DIM, MLA_DIMS = 8, 8, (24, 16)


def _comms(sizes):
    return ["p2p", "a2a", "all_gather"] + (["a2a+p2p"] if len(sizes) > 1 else [])


def _cases(mla: bool):
    windows, kvs = itertools.cycle([None, (3, 0), None, (5, 2)]), itertools.cycle([2, 8, 1, 4, 8])
    backends, sinks = itertools.cycle(["auto", "math", "auto"]), itertools.cycle([True, False, True])
    for world, sizes in HIERARCHIES:
        for comm in _comms(sizes):
            for layout in LAYOUTS:
                window, kv, backend = next(windows), next(kvs), next(backends)
                sink = next(sinks) if mla else True
                yield pytest.param(world, sizes, comm, layout, window, kv, backend, sink, mla,
                                   id=f"w{world}-{sizes}-{comm}-{layout}-win{window}-hkv{kv}-{backend}"
                                      f"{'-sink' if sink else ''}".replace(" ", ""))


def _compare(rank, world, sizes, comm, layout, window, kv_heads, backend, sink, mla, dtype):
    from mcp_context import context_parallel_attention, shard_sequence

    causal = window is None or window[1] == 0
    dqk, dv = MLA_DIMS if mla else (HEAD_DIM, HEAD_DIM)
    packed = layout.startswith("packed-")
    layout = layout.removeprefix("packed-")
    if packed:
        cu, padded, seq_len = packing(world, layout)
        cu_t, padded_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)
        ids = document_ids(seq_len, cu, padded)
        docs = {"cu_seqlens": cu_t, "cu_seqlens_padded": padded_t}
    else:
        seq_len, ids, docs = 12 * world, None, {}
    q, k, v, dout = random_qkv(seq_len, 1 if packed else 2, HEADS, kv_heads, dqk, seed=world * 7 + len(layout),
                               v_head_dim=dv)
    offset = 2.0 * torch.randn(HEADS, generator=torch.Generator().manual_seed(world), dtype=torch.float64)
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v, offset)]
    scale = 1 / math.sqrt(dqk)
    ref_out, ref_lse = full_attention(*ref_inputs[:3], causal, scale, window=window or (-1, -1), documents=ids,
                                      sink=ref_inputs[3] if sink else None)
    ref_out.backward(dout)

    def shard(x):
        return shard_sequence(x, world, rank, layout, 0, docs.get("cu_seqlens"), docs.get("cu_seqlens_padded"))

    local = [shard(x).to(dtype).requires_grad_() for x in (q, k, v)]
    local_sink = offset.to(dtype).requires_grad_() if sink else None
    out, lse = context_parallel_attention(*local, hcp_groups(sizes), causal=causal, layout=layout, comm=comm,
                                          backend=backend, return_lse=True, window_size=window,
                                          softmax_offset=local_sink, **docs)
    out.backward(shard(dout).to(dtype))
    rows = shard(ids) >= 0 if packed else torch.ones(out.shape[:3], dtype=torch.bool)
    errors = shard_errors(shard, out, lse, local, ref_out, ref_lse, ref_inputs, rows)
    sink_share = local_sink.grad.double() if sink else None
    return errors, sink_share, (ref_inputs[3].grad if sink else None), tuple(out.shape)


_case = functools.partial(in_both_dtypes, _compare)


def _check(per_rank, sink: bool, dv: int):
    for dtype in (torch.float64, torch.float32):
        for rank, results in enumerate(per_rank):
            errors, _, _, shape = results[dtype]
            assert shape[-1] == dv, (rank, shape)
            for name, err in errors.items():
                assert err <= TOL[dtype], f"rank {rank} {dtype} {name}: max abs error {err:.3e} > {TOL[dtype]}"
        if sink:
            total = sum(results[dtype][1] for results in per_rank)
            reference = per_rank[0][dtype][2]
            err = (total - reference).abs().max().item()
            assert err <= TOL[dtype] * max(1, len(per_rank)), f"{dtype} d(sink): max abs error {err:.3e}"
            assert reference.abs().max() > 1e-3  # the sink matters in this case


@pytest.mark.parametrize("world,sizes,comm,layout,window,kv_heads,backend,sink,mla", list(_cases(mla=False)))
def test_sinks_match_fp64_reference(world, sizes, comm, layout, window, kv_heads, backend, sink, mla):
    _check(run_distributed(world, _case, sizes, comm, layout, window, kv_heads, backend, sink, mla), sink, HEAD_DIM)


@pytest.mark.parametrize("world,sizes,comm,layout,window,kv_heads,backend,sink,mla", list(_cases(mla=True)))
def test_mla_head_dims_match_fp64_reference(world, sizes, comm, layout, window, kv_heads, backend, sink, mla):
    _check(run_distributed(world, _case, sizes, comm, layout, window, kv_heads, backend, sink, mla), sink,
           MLA_DIMS[1])


def test_the_matrices_cover_what_they_claim():
    sinks = [p.values for p in _cases(mla=False)]
    assert {(v[0], v[2], v[3]) for v in sinks} == {(w, c, lay) for w, s in HIERARCHIES for c in _comms(s)
                                                   for lay in LAYOUTS}
    assert {v[4] is None for v in sinks} == {True, False} and {1, 2, 4, 8} <= {v[5] for v in sinks}
    assert {(v[3].startswith("packed"), v[4] is None) for v in sinks} == set(itertools.product([True, False], repeat=2))
    mla = [p.values for p in _cases(mla=True)]
    assert {v[7] for v in mla} == {True, False}


def _one_rank_call(**kwargs):
    """``context_parallel_attention`` on a one-rank CP group (the bad-input checks run before any comm)."""
    from mcp_context import build_hcp_groups, context_parallel_attention

    q, k, v, _ = random_qkv(8, 1, 4, 2, 8, seed=0)
    args = {"q": q, "k": k, "v": v}
    args.update(kwargs)
    return context_parallel_attention(args["q"], args["k"], args["v"], build_hcp_groups([1]), comm="p2p",
                                      **{n: x for n, x in args.items() if n not in "qkv"})


def _refusal(rank, world, kwargs_name):
    cases = {
        "shape": {"softmax_offset": torch.zeros(3, dtype=torch.float64)},
        "type": {"softmax_offset": [0.0] * 4},
        "nonfinite": {"softmax_offset": torch.tensor([0.0, float("nan"), 0.0, 0.0], dtype=torch.float64)},
        "int": {"softmax_offset": torch.zeros(4, dtype=torch.int64)},
        "v_heads": {"v": torch.zeros(8, 1, 1, 16, dtype=torch.float64)},
    }
    try:
        _one_rank_call(**cases[kwargs_name])
    except (TypeError, ValueError) as err:
        return str(err)
    return None


@pytest.mark.parametrize("case,words", [("shape", ["softmax_offset", "[4]", "(3,)"]), ("type", ["softmax_offset", "list"]),
                                        ("nonfinite", ["softmax_offset", "finite"]), ("int", ["softmax_offset", "int64"]),
                                        ("v_heads", ["k and v", "heads"])])
def test_bad_sinks_and_head_dims_are_refused_naming_the_argument(case, words):
    message = run_distributed(1, _refusal, case)[0]
    assert message is not None, case
    for word in words:
        assert word in message, (word, message)


# ---- gpt-oss: Hugging Face's attention with sinks and a sliding window ------------------------------

def _gpt_oss_case(rank, world, sizes, comm, dtype=torch.float64):
    """HF ``GptOssAttention`` (eager, sliding-window layer, learned sinks) on the full sequence against
    its own projections, RoPE and sinks run through our engine at CP=``world``; input and sink
    gradients are summed over the CP ranks before comparing."""
    import torch.distributed as dist
    from transformers import GptOssConfig
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding, apply_rotary_pos_emb

    from mcp_context import context_parallel_attention, shard_sequence

    seq_len, window = 16 * world, 11
    config = GptOssConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                          sliding_window=window, layer_types=["sliding_attention"], num_hidden_layers=1,
                          attention_bias=True, attn_implementation="eager")
    torch.manual_seed(0)
    attn = GptOssAttention(config, layer_idx=0).to(dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.2)
        attn.sinks.normal_(0.0, 2.0)
    x = torch.randn(1, seq_len, config.hidden_size, dtype=dtype, requires_grad=True)
    dout = torch.randn(1, seq_len, config.hidden_size, dtype=dtype)
    positions = torch.arange(seq_len)[None]
    cos, sin = GptOssRotaryEmbedding(config)(x, positions)
    mask = create_sliding_window_causal_mask(config, x, None, None, position_ids=positions,
                                             allow_is_causal_skip=False)
    ref, _ = attn(x, (cos, sin), mask)
    ref_dx, ref_dsink = torch.autograd.grad(ref, (x, attn.sinks), dout)

    # Ours: the same projections and RoPE on the full sequence, attention over sharded q, k, v.
    hidden = (1, seq_len, -1, config.head_dim)
    q, k, v = (proj(x).view(hidden).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)

    def shard(t):  # [1, h, S, d] -> this rank's [s_local, 1, h, d] (sbhd)
        return shard_sequence(t.permute(2, 0, 1, 3), world, rank, "zigzag", dim=0)

    # Megatron/TE's window (left, 0) with left = sliding_window - 1: HF's window counts the query itself.
    out = context_parallel_attention(shard(q), shard(k), shard(v), hcp_groups(sizes), causal=True,
                                     comm=comm, window_size=(window - 1, 0), softmax_offset=attn.sinks)
    out = attn.o_proj(out.reshape(out.shape[0], 1, -1))  # [s_local, 1, hidden]
    ref_local = shard_sequence(ref.transpose(0, 1), world, rank, "zigzag", dim=0)
    dx, dsink = torch.autograd.grad(out, (x, attn.sinks), shard_sequence(dout.transpose(0, 1), world, rank,
                                                                         "zigzag", dim=0))
    for g in (dx, dsink):
        dist.all_reduce(g, group=hcp_groups(sizes).cp_group)
    return {"out": (out - ref_local).abs().max().item(), "dx": (dx - ref_dx).abs().max().item(),
            "dsink": (dsink - ref_dsink).abs().max().item(), "sink_grad": ref_dsink.abs().max().item()}


@pytest.mark.parametrize("sizes,comm", [([4], "p2p"), ([2, 2], "a2a+p2p")])
def test_gpt_oss_attention_with_sinks_and_window_matches_hugging_face_at_cp4(sizes, comm):
    pytest.importorskip("transformers", reason="the gpt-oss reference is Hugging Face's GptOssAttention")
    for rank, errors in enumerate(run_distributed(4, _gpt_oss_case, sizes, comm)):
        assert errors["sink_grad"] > 1e-3, errors  # the sinks matter here
        for name in ("out", "dx", "dsink"):
            assert errors[name] <= 1e-10, (rank, name, errors)
