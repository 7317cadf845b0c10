"""Sliding-window attention through every scheme, layout and hierarchy, against an fp64 reference.

The reference (``tests.reference.full_attention`` with ``window``) applies the window by comparing
positions, sharing no code with the package. Windows: smaller than a zigzag chunk, about one shard,
spanning several shards, and longer than the sequence; causal (left windows) and not (left and
right windows, one-sided ones included). Axes are cycled, not multiplied, as in test_engine_dist.
Also: the schedule skips the ring steps a window makes empty, the fused CPU kernel computes the
window's lower edge (anticausal squares), and bad windows are refused with the fix named.
"""
from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from mcp_context.kernels import get_kernel
from mcp_context.kernels.math import MathKernel
from mcp_context.kernels.torch_sdpa import cpu_flash_kernel
from mcp_context.layouts import spans_positions
from mcp_context.masks import ANTICAUSAL_BLOCK, CAUSAL, CAUSAL_BLOCK, FULL, BlockMask, SlidingWindow, attention_mask
from mcp_context.schedule import layout_schedule
from tests._dist import hcp_groups, run_distributed
from tests.reference import assert_within_tolerance, full_attention, in_both_dtypes, random_qkv

FUSED_MASKS = frozenset({"full", "causal", "anticausal"})
CPU = torch.device("cpu")


def _windows(seq_len: int, world: int) -> list[tuple[str, bool, tuple[int, int]]]:
    """(name, causal, window) for a sequence of ``seq_len`` over ``world`` ranks (shard ``seq_len/world``)."""
    shard = seq_len // world
    return [
        ("chunk-causal", True, (shard // 4, 0)),           # inside a zigzag chunk (shard/2)
        ("chunk-both", False, (2, 3)),
        ("shard-causal", True, (shard, 0)),
        ("shard-both", False, (shard - 1, shard + 1)),
        ("shards-causal", True, (3 * shard + 1, 0)),
        ("shards-both", False, (2 * shard + 3, shard + 5)),
        ("longer-causal", True, (2 * seq_len, 7)),          # right is capped at 0 by causal
        ("longer-both", False, (2 * seq_len, 2 * seq_len)),
        ("right-only", False, (-1, shard // 2)),
        ("left-only", False, (shard + 2, -1)),
    ]


HIERARCHIES = [(2, [2]), (4, [4]), (4, [2, 2]), (8, [2, 2, 2])]
LAYOUTS = ["zigzag", "contiguous", "striped"]


def _cases():
    # periods 10, 4 and 3: every window meets both kernels (the fused CPU op cuts bands into pieces)
    windows, kvs = itertools.cycle(range(10)), itertools.cycle([2, 8, 1, 4])
    backends = itertools.cycle(["auto", "math", "auto"])
    for world, sizes in HIERARCHIES:
        for comm in ["p2p", "a2a", "all_gather"] + (["a2a+p2p"] if len(sizes) > 1 else []):
            for layout in LAYOUTS:
                w, kv_heads, backend = next(windows), next(kvs), next(backends)
                name = _windows(12 * world, world)[w][0]
                yield pytest.param(world, sizes, comm, layout, w, kv_heads, backend,
                                   id=f"w{world}-{sizes}-{comm}-{layout}-{name}-hkv{kv_heads}-{backend}"
                                   .replace(" ", ""))


def _compare(rank, world, sizes, comm, layout, w, kv_heads, backend, dtype):
    from mcp_context import context_parallel_attention, shard_sequence

    seq_len, batch, heads, head_dim = 12 * world, 2, 8, 8
    _, causal, window = _windows(seq_len, world)[w]
    scale = 1 / math.sqrt(head_dim)
    q, k, v, dout = random_qkv(seq_len, batch, heads, kv_heads, head_dim, seed=world * 10 + w)
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = full_attention(*ref_inputs, causal, scale, window=window)
    ref_out.backward(dout)

    def shard(x):
        return shard_sequence(x, world, rank, layout, dim=0)

    local = [shard(x).to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = context_parallel_attention(*local, hcp_groups(sizes), causal=causal, layout=layout, comm=comm,
                                          backend=backend, return_lse=True, window_size=window)
    out.backward(shard(dout).to(dtype))
    pairs = {"out": (out, ref_out), "lse": (lse, ref_lse), "dq": (local[0].grad, ref_inputs[0].grad),
             "dk": (local[1].grad, ref_inputs[1].grad), "dv": (local[2].grad, ref_inputs[2].grad)}
    return {name: (a.double() - shard(b.detach())).abs().max().item() for name, (a, b) in pairs.items()}


_case = functools.partial(in_both_dtypes, _compare)


@pytest.mark.parametrize("world,sizes,comm,layout,w,kv_heads,backend", list(_cases()))
def test_windowed_attention_matches_fp64_reference(world, sizes, comm, layout, w, kv_heads, backend):
    per_rank = run_distributed(world, _case, sizes, comm, layout, w, kv_heads, backend)
    for rank, errors in enumerate(per_rank):
        for dtype, errs in errors.items():
            assert_within_tolerance(rank, dtype, errs)


def test_every_window_appears_with_both_kernels():
    """The cycled matrix covers every window kind with the fused CPU op and with the math kernel."""
    seen = {(p.values[4], p.values[6]) for p in _cases()}
    assert seen == set(itertools.product(range(10), ["auto", "math"]))


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, band: tuple) -> torch.Tensor:
    """Pairs with ``lo <= key position - query position <= hi`` (None: unbounded)."""
    d = k_pos[None, :] - q_pos[:, None]
    lo, hi = band
    keep = torch.ones(d.shape, dtype=torch.bool)
    if lo is not None:
        keep &= d >= lo
    if hi is not None:
        keep &= d <= hi
    return keep


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp,inner", [(2, 1), (4, 1), (4, 2), (8, 2), (8, 8)])
@pytest.mark.parametrize("kernel_masks", [FUSED_MASKS, frozenset({"full", "causal"}), None],
                         ids=["fused", "causal-only", "math"])
def test_window_tasks_cover_every_visible_pair_exactly_once(layout, cp, inner, kernel_masks):
    """Each task has a kind the kernel declares (causal/anticausal on squares); together the tasks of a
    step cover exactly the pairs the window shows."""
    seq = 12 * cp
    for _, causal, window in _windows(seq, cp)[:8:3] + _windows(seq, cp)[8:]:
        mask = attention_mask(causal, window)
        args = (layout, cp, seq, mask, inner) + ((kernel_masks,) if kernel_masks else ())
        sch = layout_schedule(*args)
        for m in range(sch.ring_size):
            q_pos = spans_positions(sch.member_spans[m])
            for step in range(sch.ring_size):
                k_pos = spans_positions(sch.member_spans[sch.kv_source(m, step)])
                covered = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int)
                for t in sch.tasks[m][step]:
                    n, k = t.q[1] - t.q[0], t.kv[1] - t.kv[0]
                    assert kernel_masks is None or t.mask.kind in kernel_masks, t
                    assert t.mask.kind not in ("causal", "anticausal") or n == k, t
                    block = t.mask.visible(n, k).int()
                    assert block.sum().item() == t.useful_pairs
                    covered[t.q[0]:t.q[1], t.kv[0]:t.kv[1]] += block
                assert torch.equal(covered, _visible(q_pos, k_pos, mask.band()).int()), (mask, m, step)


@pytest.mark.parametrize("layout,steps", [
    ("contiguous", lambda m, p: {0} if m == 0 else {0, 1}),
    ("zigzag", lambda m, p: {0, p - 1} if m == 0 else {0, 1} if m == p - 1 else {0, 1, p - 1}),
])
def test_a_window_of_a_quarter_shard_skips_every_step_out_of_reach(layout, steps):
    """P = 8, causal window S/(4P): only the own shard and the neighbours holding the previous positions
    get tasks (contiguous: the shard before; zigzag: the chunk before each of the two chunks), and the
    tasks hold exactly the window's pairs: sum over i of min(i, w) + 1."""
    p, seq = 8, 8 * 256
    w = seq // (4 * p)
    sch = layout_schedule(layout, p, seq, SlidingWindow(w, 0), 1, FUSED_MASKS)
    for m in range(p):
        busy = {step for step in range(p) if sch.tasks[m][step]}
        assert busy == steps(m, p), (m, busy)
    assert sum(sch.useful_pairs()) == sum(min(i, w) + 1 for i in range(seq))
    assert sum(sch.useful_pairs()) < sum(layout_schedule(layout, p, seq, CAUSAL).useful_pairs()) / 7


@pytest.mark.parametrize("kernel_masks", [FUSED_MASKS, MathKernel.capabilities.masks], ids=["fused", "math"])
def test_a_quarter_shard_window_reads_only_the_halo_rows(kernel_masks):
    """What a transfer would have to bring for a causal window of S/(4P), P = 8: contiguous, the last w
    rows of the previous shard; zigzag, the last w rows of the chunk before each of a rank's chunks
    (the neighbour's first chunk at step 1, the other neighbour's second chunk at step P - 1)."""
    p, seq = 8, 8 * 256
    w, n = seq // (4 * p), seq // p
    contiguous = layout_schedule("contiguous", p, seq, SlidingWindow(w, 0), 1, kernel_masks)
    zigzag = layout_schedule("zigzag", p, seq, SlidingWindow(w, 0), 1, kernel_masks)
    for m in range(p):
        assert contiguous.kv_rows(m, 0) == ((0, n),)
        assert contiguous.kv_rows(m, 1) == (((n - w, n),) if m > 0 else ())
        assert all(contiguous.kv_rows(m, step) == () for step in range(2, p))
        assert zigzag.kv_rows(m, 1) == (((n // 2 - w, n // 2),) if m > 0 else ())
        assert zigzag.kv_rows(m, p - 1) == (((n - w, n),) if m < p - 1 else ())
        assert all(zigzag.kv_rows(m, step) == () for step in range(2, p - 1))


def test_window_schedule_has_the_same_pairs_for_every_kernel():
    """How a band is cut (math: band blocks; fused: full, causal and anticausal pieces) changes the tasks,
    never which pairs are computed."""
    mask = SlidingWindow(37, 11)
    by_kernel = [layout_schedule("striped", 4, 4 * 96, mask, 1, masks).useful_pairs()
                 for masks in (FUSED_MASKS, frozenset({"full", "causal"}), MathKernel.capabilities.masks)]
    assert by_kernel[0] == by_kernel[1] == by_kernel[2]


@pytest.mark.parametrize("mask,n,m", [(ANTICAUSAL_BLOCK, 24, 24), (BlockMask(-3, 5), 24, 40),
                                      (BlockMask(2, 9), 17, 30)])
def test_block_masks_match_the_reference(mask, n, m):
    """The fused CPU op computes anticausal squares (rows flipped); the math kernel computes any band.
    Forward and backward from the block's own (out, lse), against an explicit fp64 softmax."""
    gen = torch.Generator().manual_seed(n + m)
    q, do = (torch.randn(1, 4, n, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, m, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    scores = torch.einsum("bhqd,bhkd->bhqk", leaves[0], leaves[1].repeat_interleave(2, 1)) * 0.3
    scores = scores.masked_fill(~mask.visible(n, m), float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)
    ref_out = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, -1), leaves[2].repeat_interleave(2, 1))
    ref_out.backward(do)
    kernels = [MathKernel()] + ([get_kernel("torch:cpu_flash", CPU, torch.float64)] if mask.kind == "anticausal"
                                else [])
    for kernel in kernels:
        out, lse = kernel.forward(q, k, v, mask, 0.3)
        grads = kernel.backward(do, q, k, v, ref_out.detach(), ref_lse.detach(), mask, 0.3)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(grads),
                              (ref_out, ref_lse) + tuple(x.grad for x in leaves)):
            assert (a - b.detach()).abs().max().item() <= 1e-10, (kernel.name, name)


def test_fused_op_refuses_a_band_it_cannot_compute():
    kernel = get_kernel("torch:cpu_flash", CPU, torch.float64)
    q = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="not a band mask on a 8x8 block.*capabilities.masks.*backend='math'"):
        kernel.forward(q, q, q, BlockMask(-2, 2), 0.3)


def test_window_size_maps_onto_mask_values():
    assert attention_mask(True, None) == attention_mask(True, (-1, -1)) == attention_mask(True, (-1, 5)) == CAUSAL
    assert attention_mask(False, None) == attention_mask(False, (-1, -1)) == FULL
    assert attention_mask(True, (16, 16)) == SlidingWindow(16, 0)  # causal caps right at 0
    assert attention_mask(False, [16, 3]) == SlidingWindow(16, 3)
    assert SlidingWindow(16, 3).window_size == (16, 3) and CAUSAL.window_size == (-1, 0)


@pytest.mark.parametrize("window,match", [
    ((-2, 0), r"window_size=\(-2, 0\): left=-2 is negative; use a number of positions >= 0, or -1 for an unbounded"),
    ((4, -7), r"window_size=\(4, -7\): right=-7 is negative; .* or -1 for an unbounded right side"),
    ((4,), r"window_size=\(4,\) must be None or a pair \(left, right\) of ints"),
    (8, r"window_size=8 must be None or a pair"),
    ((4.5, 0), r"left must be an int \(>= 0, or -1 for unbounded\), not float"),
    ((True, 0), r"left must be an int .* not bool"),
])
def test_bad_windows_are_refused_naming_the_fix(window, match):
    from mcp_context import ContextParallelAttention, context_parallel_attention

    with pytest.raises(ValueError, match=match):
        ContextParallelAttention(None, causal=True, comm="p2p", window_size=window)
    t = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match=match):
        context_parallel_attention(t, t, t, None, comm="p2p", window_size=window)
    with pytest.raises(ValueError, match=match):
        SlidingWindow(*window) if isinstance(window, tuple) and len(window) == 2 else attention_mask(False, window)


class _CountingKernel(MathKernel):
    """The math kernel, counting forward and backward calls (the step is read from the caller's plan)."""

    def __init__(self):
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return super().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.calls += 1
        return super().backward(*args, **kwargs)


def test_steps_without_tasks_run_no_kernel():
    """One ring member run on one device (every shard local): a window of S/(4P) calls the kernel only for
    the tasks of the steps within reach, forward and backward, and the result is still exact."""
    from mcp_context.algorithms.executor import RingAttention, RingPlan
    from mcp_context.algorithms.rotation import LocalRotation

    p, seq, member = 8, 8 * 16, 3
    window = (seq // (4 * p), 0)
    q, k, v, dout = random_qkv(seq, 1, 4, 2, 8, seed=3)
    sch = layout_schedule("zigzag", p, seq, attention_mask(True, window))
    order = torch.cat([spans_positions(spans) for spans in sch.member_spans])
    rows = spans_positions(sch.member_spans[member])
    kernel = _CountingKernel()
    plan = RingPlan.build(sch.tasks[member], LocalRotation(member, p), kernel, 0.3, len(rows))
    qm = q[rows].clone().requires_grad_()
    out, _ = RingAttention.apply(qm, k[order], v[order], plan)
    out.backward(dout[rows])
    assert kernel.calls == 2 * sum(len(step) for step in sch.tasks[member])
    assert [step for step in range(p) if sch.tasks[member][step]] == [0, 1, p - 1]
    ref_q = q.clone().requires_grad_()
    ref_out, _ = full_attention(ref_q, k, v, True, 0.3, window=window)
    ref_out.backward(dout)
    assert (out.detach() - ref_out.detach()[rows]).abs().max().item() <= 1e-12
    assert (qm.grad - ref_q.grad[rows]).abs().max().item() <= 1e-12


def _halo_bytes_case(rank, world, layout):
    from mcp_context import build_hcp_groups, context_parallel_attention, shard_sequence
    from mcp_context.trace import comm_stats

    seq, heads, kv_heads, head_dim = world * 32, 4, 2, 8
    window = (seq // (4 * world), 0)
    q, k, v, dout = random_qkv(seq, 1, heads, kv_heads, head_dim, seed=5)
    leaves = [shard_sequence(x, world, rank, layout).requires_grad_() for x in (q, k, v)]
    before, before_to, before_calls = comm_stats.snapshot()
    out = context_parallel_attention(*leaves, build_hcp_groups([world]), causal=True, layout=layout, comm="p2p",
                                     window_size=window, check_ranks=False)
    out.backward(shard_sequence(dout, world, rank, layout))
    after, after_to, after_calls = comm_stats.snapshot()
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, _ = full_attention(*ref, True, head_dim ** -0.5, window=window)
    ref_out.backward(dout)
    errors = [(a - shard_sequence(b, world, rank, layout)).abs().max().item()
              for a, b in zip([out] + [x.grad for x in leaves], [ref_out] + [x.grad for x in ref])]
    sent = {op: after.get(op, 0) - before.get(op, 0) for op in ("ring_kv", "ring_dkv")}
    to = {op: sorted(p for p, n in after_to.get(op, {}).items() if n != before_to.get(op, {}).get(p, 0))
          for op in ("ring_kv", "ring_dkv")}
    calls = {op: after_calls.get(op, 0) - before_calls.get(op, 0) for op in ("ring_kv", "ring_dkv")}
    return sent, to, calls, max(errors)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_a_quarter_shard_window_moves_only_the_halo(layout):
    """P = 8, causal window w = S/(4P), p2p: each rank sends only the w rows of K/V its neighbours read
    (forward and backward walk) and gets back their dK/dV, to exactly those neighbours; no other step
    posts a transfer. Bytes: rows * b * h_kv * d * 2 (K, V) * 8 (fp64), twice, plus dK/dV once."""
    p = 8
    w, row = 32 // 4, 1 * 2 * 8 * 2 * 8  # rows of the window; bytes of one K+V row (b=1, h_kv=2, d=8, fp64)
    for rank, (sent, to, calls, err) in enumerate(run_distributed(p, _halo_bytes_case, layout)):
        if layout == "contiguous":  # K/V to the next rank, dK/dV back to the previous
            kv_to, dkv_to = [rank + 1] if rank < p - 1 else [], [rank - 1] if rank > 0 else []
        else:  # first chunk's tail to the next rank, second chunk's tail to the previous; dK/dV the other way
            kv_to = dkv_to = [r for r in (rank - 1, rank + 1) if 0 <= r < p]
        assert to == {"ring_kv": kv_to, "ring_dkv": dkv_to}, rank
        assert sent == {"ring_kv": 2 * len(kv_to) * w * row, "ring_dkv": len(dkv_to) * w * row}, rank
        assert calls == {"ring_kv": 2 * len(kv_to), "ring_dkv": len(dkv_to)}, rank
        assert err <= 1e-10, (rank, err)


def test_a_diagonal_run_of_a_kind_the_fused_op_lacks_is_refused_not_run_as_causal():
    """The fold keeps the run's kind: a diagonal run of band squares reaches the op's own check and is
    refused (a fused op computes full and causal squares only), never computed as causal squares."""
    x = torch.randn(1, 2, 12, 4, dtype=torch.float64)
    for call in (lambda k: k.forward(x, x, x, BlockMask(-1, 1, 3), 0.5),
                 lambda k: k.backward(x, x, x, x, x, x[..., 0], BlockMask(-1, 1, 3), 0.5)):
        with pytest.raises(ValueError, match="not a band mask on a 4x4 block"):
            call(cpu_flash_kernel())


@pytest.mark.parametrize("kind,g,n", [("causal", 4, 5), ("anticausal", 3, 7), ("causal", 6, 1)])
def test_diagonal_block_masks_run_as_one_call_and_match_the_reference(kind, g, n):
    """A diagonal run (``g`` equal ``n x n`` squares, one task) through the fused CPU op (squares folded
    into the batch) and the math kernel, forward and backward, against an explicit fp64 softmax whose
    mask is built square by square (``torch.block_diag`` of ``tril``/``triu``), within 1e-10."""
    square = torch.ones(n, n, dtype=torch.bool)
    square = square.tril() if kind == "causal" else square.triu()
    visible = torch.block_diag(*[square] * g)
    mask = BlockMask(None, 0, g) if kind == "causal" else BlockMask(0, None, g)
    assert torch.equal(mask.visible(g * n, g * n), visible) and mask.pairs(g * n, g * n) == visible.sum().item()
    gen = torch.Generator().manual_seed(g * n)
    q, do = (torch.randn(2, 4, g * n, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, g * n, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    scores = torch.einsum("bhqd,bhkd->bhqk", leaves[0], leaves[1].repeat_interleave(2, 1)) * 0.3
    scores = scores.masked_fill(~visible, float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)
    ref_out = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, -1), leaves[2].repeat_interleave(2, 1))
    ref_out.backward(do)
    for kernel in (MathKernel(), get_kernel("torch:cpu_flash", CPU, torch.float64)):
        out, lse = kernel.forward(q, k, v, mask, 0.3)
        grads = kernel.backward(do, q, k, v, ref_out.detach(), ref_lse.detach(), mask, 0.3)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(grads),
                              (ref_out, ref_lse) + tuple(x.grad for x in leaves)):
            assert (a - b.detach()).abs().max().item() <= 1e-10, (kernel.name, name)


@pytest.mark.parametrize("layout,inner,most", [("zigzag", 1, 12), ("contiguous", 1, 6), ("striped", 1, 6),
                                               ("zigzag", 2, 14)])
def test_a_narrow_window_at_32k_is_a_few_tasks_per_step_and_still_exact(layout, inner, most):
    """Window (63, 0) at S = 32768 over P = 8 for the fused ops' mask set: at most ``most`` tasks per
    step (a run's tasks hold ``RUN_ROWS`` rows; cut square by square it was 127 per step for zigzag
    and 1024 for striped: launches, not FLOPs, bound that on a GPU). The pairs stay exact: every pair
    the tasks cover is in the window, none is covered twice, and there are as many as the window holds
    (sum over i of min(i, 63) + 1)."""
    seq, p, left = 32768, 8, 63
    sch = layout_schedule(layout, p, seq, SlidingWindow(left, 0), inner, FUSED_MASKS)
    assert max(len(step) for member in sch.tasks for step in member) == most
    pair_ids = []
    for m in range(sch.ring_size):
        q_pos = spans_positions(sch.member_spans[m])
        for step in range(sch.ring_size):
            k_pos = spans_positions(sch.member_spans[sch.kv_source(m, step)])
            for t in sch.tasks[m][step]:
                assert t.mask.kind in FUSED_MASKS, t
                rows, keys = t.mask.visible(t.q[1] - t.q[0], t.kv[1] - t.kv[0]).nonzero().unbind(1)
                qp, kp = q_pos[t.q[0] + rows], k_pos[t.kv[0] + keys]
                assert bool(((qp - kp >= 0) & (qp - kp <= left)).all()), t
                pair_ids.append(qp * seq + kp)
    pair_ids = torch.cat(pair_ids)
    assert len(pair_ids) == sum(min(i, left) + 1 for i in range(seq)) == len(torch.unique(pair_ids))


def test_diagonal_runs_through_the_ring_executor_match_the_reference():
    """Every member of a P = 4 zigzag ring on one device (every shard local), causal window (7, 0), the
    fused CPU op: the schedule holds diagonal runs, and out, dq, dk, dv (dk/dv summed over members)
    match an fp64 reference within 1e-10."""
    from mcp_context.algorithms.executor import RingAttention, RingPlan
    from mcp_context.algorithms.rotation import LocalRotation

    p, seq, window = 4, 4 * 64, (7, 0)
    q, k, v, dout = random_qkv(seq, 2, 4, 2, 8, seed=11)
    sch = layout_schedule("zigzag", p, seq, attention_mask(True, window), 1, FUSED_MASKS)
    assert any(t.mask.diagonal > 1 for member in sch.tasks for step in member for t in step)
    order = torch.cat([spans_positions(spans) for spans in sch.member_spans])
    kernel = get_kernel("torch:cpu_flash", CPU, torch.float64)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, _ = full_attention(*ref, True, 0.3, window=window)
    ref_out.backward(dout)
    kv = [x[order].detach().requires_grad_() for x in (k, v)]
    for member in range(p):
        rows = spans_positions(sch.member_spans[member])
        plan = RingPlan.build(sch.tasks[member], LocalRotation(member, p), kernel, 0.3, len(rows))
        qm = q[rows].clone().requires_grad_()
        out, _ = RingAttention.apply(qm, *kv, plan)
        out.backward(dout[rows])
        assert (out.detach() - ref_out.detach()[rows]).abs().max().item() <= 1e-10, member
        assert (qm.grad - ref[0].grad[rows]).abs().max().item() <= 1e-10, member
    for got, want in zip(kv, ref[1:]):
        assert (got.grad - want.grad[order]).abs().max().item() <= 1e-10


def test_size_dispatch_sends_a_run_of_small_squares_to_the_small_block_kernel():
    """``auto`` on CUDA gives blocks up to 1024 rows to flash and larger ones to cuDNN; a diagonal run of
    64-row squares over 2048 rows is one call of 64-row blocks, so it goes to the small-block kernel (here
    the math kernel; the large one is the fused CPU op)."""
    from mcp_context.kernels.registry import SizeDispatchKernel

    small, large = MathKernel(), get_kernel("torch:cpu_flash", CPU, torch.float64)
    kernel = SizeDispatchKernel(small, large, max_small_rows=1024)
    q = torch.randn(1, 2, 2048, 8, dtype=torch.float64)
    assert kernel._pick(q, q, BlockMask(None, 0, 32)) is small and kernel._pick(q, q, BlockMask(None, 0)) is large
    assert kernel._pick(q, q, BlockMask(0, None, 2)) is small and kernel._pick(q, q, CAUSAL_BLOCK) is large
