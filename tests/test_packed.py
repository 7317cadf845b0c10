"""Packed sequences (cu_seqlens, Megatron/TE thd) through every scheme, both packed layouts and every
hierarchy, against an fp64 reference with a document mask.

The reference (``tests.reference.full_attention`` with ``documents``) masks by comparing document ids,
sharing no code with the package. Packings hold documents of length 1, odd lengths, documents shorter
than a chunk and one longer than a shard, and tail padding; padding rows must come back with ``out``
0, ``lse`` -inf and exactly zero gradients. Axes are cycled, not multiplied, as in test_window.
Also: the schedule's tasks never cross a document and cover exactly the visible pairs, steps no query
reaches are skipped (and, on the halo rotation, not transferred), the layouts' shards and positions,
the balanced layout's balance, and bad input refused with the fix named. (Transfers:
test_packed_transfers.py; Megatron: test_packed_megatron.py.)
"""
from __future__ import annotations

import functools
import itertools
import math
import re

import pytest
import torch

from mcp_context.layouts import layout_spans, shard_index, shard_positions, shard_sequence, unshard_sequence
from mcp_context.masks import CAUSAL, FULL, Documents, SlidingWindow, documents_mask
from mcp_context.schedule import layout_schedule, load_balance
from tests._dist import hcp_groups, run_distributed
from tests.reference import (assert_within_tolerance, document_ids, full_attention, in_both_dtypes, random_qkv,
                             shard_errors)

CPU_FUSED = frozenset({"full", "causal", "anticausal"})
HIERARCHIES = [(2, [2]), (4, [4]), (4, [2, 2]), (8, [2, 2, 2])]
WITHIN = [(True, None), (True, (3, 0)), (False, None), (False, (2, 5))]  # (causal, window) inside documents


def packing(world: int, layout: str) -> tuple[list[int], list[int], int]:
    """``(cu_seqlens, cu_seqlens_padded, seq_len)`` for ``world`` ranks: documents of 1 row, an odd
    length, 3 rows (shorter than a chunk), one longer than a shard, 5 rows; then tail padding.
    ``zigzag``: every document padded to a multiple of ``2 * world``; ``balanced``: only the tail."""
    lengths = [1, 2 * world + 1, 3, 16 * world + 1, 5]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if layout == "zigzag":
        multiple = 2 * world
        padded = [0]
        for n in lengths:
            padded.append(padded[-1] + n + (-n % multiple))
        padded[-1] += multiple  # a whole chunk of tail padding after the last document's own
    else:
        padded = cu[:-1] + [cu[-1] + world + (-cu[-1] % world)]
        padded[3] += 2  # the 3-row document gets 2 padding rows too
        padded[4] += 2
    return cu, padded, padded[-1]


def _cases():
    within, kvs = itertools.cycle([0, 1, 2, 3, 1, 0, 3, 2]), itertools.cycle([2, 8, 1, 4])
    backends = itertools.cycle(["auto", "math", "auto"])
    for world, sizes in HIERARCHIES:
        for comm in ["p2p", "a2a", "all_gather"] + (["a2a+p2p"] if len(sizes) > 1 else []):
            for layout in ["zigzag", "balanced"]:
                w, kv_heads, backend = next(within), next(kvs), next(backends)
                yield pytest.param(world, sizes, comm, layout, w, kv_heads, backend,
                                   id=f"w{world}-{sizes}-{comm}-{layout}-within{w}-hkv{kv_heads}-{backend}"
                                   .replace(" ", ""))


def _compare(rank, world, sizes, comm, layout, w, kv_heads, backend, dtype):
    from mcp_context import context_parallel_attention

    cu, padded, seq_len = packing(world, layout)
    causal, window = WITHIN[w]
    heads, head_dim = 8, 8
    q, k, v, dout = random_qkv(seq_len, 1, heads, kv_heads, head_dim, seed=world * 10 + w)
    ids = document_ids(seq_len, cu, padded)
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = full_attention(*ref_inputs, causal, 1 / math.sqrt(head_dim), window=window or (-1, -1),
                                      documents=ids)
    ref_out.backward(dout)
    cu_t, padded_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)

    def shard(x):
        return shard_sequence(x, world, rank, layout, 0, cu_t, padded_t)

    local = [shard(x).to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = context_parallel_attention(*local, hcp_groups(sizes), causal=causal, layout=layout, comm=comm,
                                          backend=backend, return_lse=True, window_size=window, cu_seqlens=cu_t,
                                          cu_seqlens_padded=padded_t)
    out.backward(shard(dout).to(dtype))
    pad = shard(ids) < 0
    errors = shard_errors(shard, out, lse, local, ref_out, ref_lse, ref_inputs, ~pad)
    padding = {"rows": int(pad.sum()), "out": out[pad].abs().sum().item(),  # sums of |x|: 0 iff all are 0
               "lse_inf": bool(torch.isneginf(lse[pad]).all()),
               "grads": sum(x.grad[pad].abs().sum().item() for x in local)}
    return errors, padding


_case = functools.partial(in_both_dtypes, _compare)


@pytest.mark.parametrize("world,sizes,comm,layout,w,kv_heads,backend", list(_cases()))
def test_packed_attention_matches_fp64_reference(world, sizes, comm, layout, w, kv_heads, backend):
    per_rank = run_distributed(world, _case, sizes, comm, layout, w, kv_heads, backend)
    assert sum(r[torch.float64][1]["rows"] for r in per_rank) > 0  # some rank holds padding rows
    for rank, results in enumerate(per_rank):
        for dtype, (errors, padding) in results.items():
            assert_within_tolerance(rank, dtype, errors)
            if padding["rows"]:
                assert padding["out"] == 0.0 and padding["grads"] == 0.0 and padding["lse_inf"], (rank, padding)


def test_the_matrix_covers_every_within_mask_with_both_kernels_and_both_layouts():
    seen = {(p.values[3], p.values[4], p.values[6]) for p in _cases()}
    assert {(lay, w) for lay, w, _ in seen} == set(itertools.product(["zigzag", "balanced"], range(len(WITHIN))))
    assert {(lay, b) for lay, _, b in seen} == set(itertools.product(["zigzag", "balanced"], ["auto", "math"]))


def test_packings_hold_the_documents_the_issue_asks_for():
    for world, _ in HIERARCHIES:
        for layout in ("zigzag", "balanced"):
            cu, padded, seq_len = packing(world, layout)
            lengths = [b - a for a, b in zip(cu, cu[1:])]
            assert 1 in lengths and any(n % 2 and n > 1 for n in lengths)
            assert min(lengths) < seq_len // (2 * world) < seq_len // world < max(lengths)
            assert padded[-1] - padded[-2] > lengths[-1]  # tail padding


# ---- the schedule ---------------------------------------------------------------------------------

def _doc_of(documents: Documents, positions: torch.Tensor) -> torch.Tensor:
    return document_ids(documents.seq_len, list(documents.cu_seqlens), list(documents.starts))[positions]


def _visible(documents: Documents, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    dq, dk = _doc_of(documents, q_pos), _doc_of(documents, k_pos)
    keep = (dq[:, None] == dk[None, :]) & (dq[:, None] >= 0)
    d = k_pos[None, :] - q_pos[:, None]
    lo, hi = documents.within.band()
    if lo is not None:
        keep &= d >= lo
    if hi is not None:
        keep &= d <= hi
    return keep


@pytest.mark.parametrize("layout,cp,inner", [("zigzag", 2, 1), ("zigzag", 4, 2), ("zigzag", 8, 1), ("balanced", 2, 1),
                                             ("balanced", 4, 1), ("balanced", 8, 2), ("contiguous", 4, 1),
                                             ("striped", 4, 2)])
@pytest.mark.parametrize("within", [CAUSAL, FULL, SlidingWindow(3, 0), SlidingWindow(2, 5)],
                         ids=["causal", "full", "window", "window-both"])
@pytest.mark.parametrize("kernel_masks", [CPU_FUSED, None], ids=["fused", "math"])
def test_tasks_never_cross_a_document_and_cover_every_visible_pair_once(layout, cp, inner, within, kernel_masks):
    cu, padded, seq = packing(cp, "zigzag" if layout in ("zigzag", "striped", "contiguous") else "balanced")
    documents = documents_mask(cu, padded, within)
    sch = layout_schedule(layout, cp, seq, documents, inner, *([kernel_masks] if kernel_masks else []))
    for m in range(sch.ring_size):
        q_pos = torch.cat([s.positions() for s in sch.member_spans[m]])
        for step in range(sch.ring_size):
            k_pos = torch.cat([s.positions() for s in sch.member_spans[sch.kv_source(m, step)]])
            covered = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int)
            for t in sch.tasks[m][step]:
                docs = set(_doc_of(documents, q_pos[t.q[0]:t.q[1]]).tolist()) | set(
                    _doc_of(documents, k_pos[t.kv[0]:t.kv[1]]).tolist())
                assert len(docs) == 1 and docs != {-1}, (m, step, t, docs)  # one document, no padding row
                assert kernel_masks is None or t.mask.kind in kernel_masks, t
                covered[t.q[0]:t.q[1], t.kv[0]:t.kv[1]] += t.mask.visible(t.q[1] - t.q[0], t.kv[1] - t.kv[0]).int()
            assert torch.equal(covered, _visible(documents, q_pos, k_pos).int()), (m, step)


def test_documents_inside_a_shard_skip_every_other_step_and_move_nothing():
    """Two documents of half a shard per rank, balanced: each stays whole on one rank, so only step 0 has
    tasks and no step reads a row of another shard (the halo rotation then posts no transfer)."""
    from mcp_context.algorithms.halo import halo_fits

    p, n = 8, 32
    cu = list(range(0, p * n + 1, n // 2))
    sch = layout_schedule("balanced", p, p * n, documents_mask(cu), 1, CPU_FUSED)
    for m in range(p):
        assert sch.tasks[m][0] and all(not sch.tasks[m][t] and sch.kv_rows(m, t) == () for t in range(1, p))
    assert load_balance(sch) == 1.0 and halo_fits(sch)


def test_zigzag_reads_only_rows_of_documents_that_reach_the_step():
    """Per-document zigzag spreads every document over every rank, but the rows a step reads are only
    those of its documents before the query (a 1-row document contributes nothing to other ranks)."""
    cu, padded, seq = packing(4, "zigzag")
    documents = documents_mask(cu, padded)
    sch = layout_schedule("zigzag", 4, seq, documents)
    for m in range(4):
        for t in range(1, 4):
            src = sch.member_spans[sch.kv_source(m, t)]
            pos = torch.cat([s.positions() for s in src])
            for a, b in sch.kv_rows(m, t):
                assert (_doc_of(documents, pos[a:b]) >= 0).all()  # padding rows are never read


# ---- layouts ----------------------------------------------------------------------------------------

def test_packed_zigzag_is_te_per_document_zigzag():
    """Rank r holds chunks r and 2cp-1-r of every document, in document order (TE's thd partitioning),
    and RoPE positions restart at every document."""
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)  # documents of 8 and 16 rows, cp = 2: chunks of 2 and 4
    assert shard_index(24, 2, 0, "zigzag", cu).tolist() == [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]
    assert shard_index(24, 2, 1, "zigzag", cu).tolist() == [2, 3, 4, 5, 12, 13, 14, 15, 16, 17, 18, 19]
    assert shard_positions(24, 2, 1, "zigzag", cu).tolist() == [2, 3, 4, 5, 4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_packed_shards_partition_the_sequence_and_round_trip(layout, cp):
    cu, padded, seq = packing(cp, layout)
    cu_t, padded_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)
    x = torch.randn(seq, 3)
    shards = [shard_sequence(x, cp, r, layout, 0, cu_t, padded_t) for r in range(cp)]
    assert all(s.shape == (seq // cp, 3) for s in shards)
    assert torch.equal(unshard_sequence(shards, layout, 0, cu_t, padded_t), x)
    starts = torch.tensor(padded[:-1])
    for r in range(cp):  # positions restart per document: the offset from the document's start
        index = shard_index(seq, cp, r, layout, cu_t, padded_t)
        doc = torch.searchsorted(starts, index, right=True) - 1
        assert torch.equal(shard_positions(seq, cp, r, layout, cu_t, padded_t), index - starts[doc])


def test_balanced_pads_no_document():
    """Documents of any length, the sequence a multiple of cp: no padding row is added or needed."""
    cu = [0, 1, 8, 11, 50, 51, 64]
    spans = [layout_spans("balanced", 4, r, 64, documents_mask(cu)) for r in range(4)]
    rows = sorted(p for sp in spans for s in sp for p in s.positions().tolist())
    assert rows == list(range(64)) and all(sum(s.count for s in sp) == 16 for sp in spans)


def test_balanced_reaches_1_05_at_p8_on_both_distributions_with_no_padding():
    """The corpus's scenes and the long-tail lengths, packed into 32K sequences (tools/packed_figures.py):
    at P = 8 the balanced layout's worst sequence is within 1.05 with no padding row; TE's per-document
    zigzag pads (its overhead is what docs/packed.md tabulates)."""
    from tools.packed_figures import distributions, figures

    for name, sequences in distributions(4).items():
        balanced, zigzag = figures(sequences, 8, "balanced"), figures(sequences, 8, "zigzag")
        assert balanced["balance"] <= 1.05 and balanced["padding"] == 0.0, (name, balanced)
        assert zigzag["padding"] > 0.0, (name, zigzag)



def test_packed_figures_host_time_prints_a_rank_s_scheme_per_comm_and_its_data_shards(monkeypatch, capsys):
    """``tools/packed_figures.py --host-time`` (docs/performance.md's packed host table): one row per case, a
    positive time per comm (each resolved in a fake process group) and for the data shards."""
    import tools.packed_figures as tool

    monkeypatch.setattr(tool, "HOST_CASES", ((2048, 4, 6),))
    tool.main(["--host-time"])
    header, rule, row = capsys.readouterr().out.strip().splitlines()
    assert header.count("|") == rule.count("|") == row.count("|") == len(tool.HOST_SCHEMES) + 3
    assert row.startswith("| 2K / 4, 6 |") and all(float(c) > 0 for c in row.strip("|").split("|")[1:])

# ---- bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("cu,padded,layout,match", [
    ([0, 5, 3, 16], None, "balanced", r"cu_seqlens=\[0, 5, 3, 16\] is not increasing: cu_seqlens\[2\]=3 < "
                                      r"cu_seqlens\[1\]=5; give cumulative document lengths"),
    ([2, 5, 16], None, "balanced", r"cu_seqlens=\[2, 5, 16\] must start at 0 .*; prepend 0"),
    ([0, 5, 12], None, "balanced", r"cu_seqlens ends at 12 but the packed sequence has 16 rows \(s_local \* cp\); "
                                   r"its last offset must be the sequence length"),
    ([0, 5, 12], [0, 8, 15], "balanced", r"cu_seqlens_padded ends at 15 but the packed sequence has 16 rows"),
    ([0, 5, 12], [0, 4, 16], "balanced", r"document 0 has 5 rows \(cu_seqlens\) but only 4 padded rows"),
    ([0, 5, 16], None, "zigzag", r"layout='zigzag' cuts every document into 2\*cp=4 chunks, but document 0 has 5 "
                                 r"\(padded\) rows; pad every document to a multiple of 4 with cu_seqlens_padded .* "
                                 r"or use layout='balanced'"),
    (torch.tensor([0, 5.0, 16]), None, "balanced", r"cu_seqlens must be a 1-D int32 \(or int64\) tensor"),
    (torch.tensor([[0, 5, 16]], dtype=torch.int32), None, "balanced", r"must be a 1-D int32 .* shape \(1, 3\)"),
])
def test_bad_packings_are_refused_naming_the_fix(cu, padded, layout, match):
    cu = cu if isinstance(cu, torch.Tensor) else torch.tensor(cu, dtype=torch.int32)
    padded = None if padded is None else torch.tensor(padded, dtype=torch.int32)
    per_rank = run_distributed(2, _error_case, cu, padded, layout, 1)
    assert per_rank[0] == per_rank[1]  # every rank raises the same error
    assert re.search(match, per_rank[0]), per_rank[0]


def _error_case(rank, world, cu, padded, layout, batch):
    from mcp_context import build_hcp_groups, context_parallel_attention

    t = torch.zeros(8, batch, 2, 4, dtype=torch.float64)
    try:
        context_parallel_attention(t, t, t, build_hcp_groups([world]), layout=layout, comm="p2p", cu_seqlens=cu,
                                   cu_seqlens_padded=padded)
    except ValueError as err:
        return str(err)
    return "no error"


def test_other_bad_uses_are_refused_naming_the_fix():
    """b != 1, cu_seqlens_padded alone, 'balanced' without documents, ranks with different packings."""
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    for args, match in [((cu, None, "balanced", 2), r"packed sequence \(cu_seqlens\) is one sequence: q must be "
                                                   r"\[s_local, 1, h, d\] \(b = 1\), got shape \(8, 2, 2, 4\); pack"),
                        ((None, cu, "zigzag", 1), r"cu_seqlens_padded was given without cu_seqlens; pass both"),
                        ((None, None, "balanced", 1), r"layout='balanced' places the documents of a packed sequence: "
                                                      r"pass cu_seqlens, or use one of contiguous, zigzag, striped")]:
        errors = run_distributed(2, _error_case, *args)
        assert errors[0] == errors[1] and re.search(match, errors[0]), errors
    with pytest.raises(ValueError, match=r"layout='balanced' places the documents of a packed sequence"):
        shard_sequence(torch.zeros(8), 2, 0, "balanced")
    with pytest.raises(ValueError, match=r"layout='balanced' gives every rank S/cp rows, but the packed sequence "
                                         r"has 10 rows, not divisible by cp=4; pad its tail to 12 rows"):
        shard_sequence(torch.zeros(10), 4, 0, "balanced", 0, torch.tensor([0, 3, 10], dtype=torch.int32))
    errors = run_distributed(2, _different_packings_case)
    assert errors[0] == errors[1] and "(cu_seqlens differ)" in errors[1], errors


def _different_packings_case(rank, world):
    from mcp_context import build_hcp_groups, context_parallel_attention

    t = torch.zeros(8, 1, 2, 4, dtype=torch.float64)
    cu = torch.tensor([0, 4 + 4 * rank, 16], dtype=torch.int32)
    try:
        context_parallel_attention(t, t, t, build_hcp_groups([world]), layout="balanced", comm="p2p", cu_seqlens=cu)
    except ValueError as err:
        return str(err)
    return "no error"


def test_cu_seqlens_without_readable_values_is_refused_naming_the_fix():
    """``cu_seqlens`` on the ``meta`` device has no values to read (it used to end in a bare
    NotImplementedError from ``.tolist()``): the package's ValueError names the argument and the fix."""
    meta = torch.tensor([0, 5, 16], dtype=torch.int32, device="meta")
    match = r"cu_seqlens is on device meta, whose values cannot be read; .* a CPU or CUDA tensor"
    with pytest.raises(ValueError, match=match):
        documents_mask(meta)
    with pytest.raises(ValueError, match=match):
        shard_sequence(torch.zeros(16), 2, 0, "balanced", 0, meta)
