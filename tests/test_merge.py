"""Online-softmax merge: exact against one softmax over the union of keys; -inf rows stay finite."""
import pytest
import torch

from mcp_context.merge import merge_blocks_


def merge_(out, lse, block_out, block_lse):
    """Fold one block into accumulators in place (the sum-so-far form of ``merge_blocks_``)."""
    merge_blocks_(out, lse, out, lse, block_out, block_lse)


def _partial(scores, v):
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return p @ v, lse


def test_merging_two_key_halves_equals_softmax_over_all_keys():
    gen = torch.Generator().manual_seed(0)
    scores, v = torch.randn(3, 5, 12, generator=gen, dtype=torch.float64) * 4, torch.randn(3, 12, 7, generator=gen,
                                                                                          dtype=torch.float64)
    out, lse = _partial(scores[..., :5], v[:, :5])
    merge_(out, lse, *_partial(scores[..., 5:], v[:, 5:]))
    ref_out, ref_lse = torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)
    assert (out - ref_out).abs().max() <= 1e-13 and (lse - ref_lse).abs().max() <= 1e-13


def test_fully_masked_rows_stay_zero_and_minus_inf_without_nan():
    out, lse = torch.zeros(2, 4, 3), torch.full((2, 4), float("-inf"))
    merge_(out, lse, torch.zeros(2, 4, 3), torch.full((2, 4), float("-inf")))
    assert (out == 0).all() and (lse == float("-inf")).all()
    block_out, block_lse = torch.randn(2, 4, 3), torch.randn(2, 4)
    merge_(out, lse, block_out, block_lse)  # first visible block: taken as is
    assert torch.equal(out, block_out) and torch.equal(lse, block_lse)
    merge_(out, lse, torch.randn(2, 4, 3), torch.full((2, 4), float("-inf")))  # an empty block changes nothing
    assert torch.equal(out, block_out) and torch.equal(lse, block_lse)


def test_merge_is_stable_for_huge_lse_gaps():
    out, lse = torch.ones(1, 1, 2), torch.tensor([[1e4]])
    merge_(out, lse, torch.full((1, 1, 2), 5.0), torch.tensor([[-1e4]]))
    assert torch.isfinite(out).all() and torch.allclose(out, torch.ones(1, 1, 2)) and lse.item() == 1e4


@pytest.mark.parametrize("blocks", [2, 3, 5, 8])
def test_merging_many_key_runs_at_once_equals_softmax_over_all_keys(blocks):
    """One merge of ``blocks`` partial results (each over its own run of keys, one run fully masked on some
    rows) is the softmax over every key, fp64 within 1e-13; rows no run sees stay (0, -inf)."""
    gen = torch.Generator().manual_seed(blocks)
    scores = torch.randn(2, 6, 4 * blocks, generator=gen, dtype=torch.float64) * 4
    v = torch.randn(2, 4 * blocks, 5, generator=gen, dtype=torch.float64)
    scores[:, 1, 4:] = float("-inf")  # row 1 sees only the first run
    scores[:, 2] = float("-inf")  # row 2 sees nothing
    parts = [x for r in range(blocks) for x in _partial(scores[..., 4 * r:4 * r + 4], v[:, 4 * r:4 * r + 4])]
    out, lse = torch.empty(2, 6, 5, dtype=torch.float64), torch.empty(2, 6, dtype=torch.float64)
    merge_blocks_(out, lse, *parts)
    ref_lse = torch.logsumexp(scores, -1)
    ref_out = torch.softmax(scores.masked_fill(ref_lse.isinf().unsqueeze(-1), 0), -1) @ v
    ref_out[:, 2] = 0
    assert (out - ref_out).abs().max() <= 1e-13 and torch.equal(lse.isinf(), ref_lse.isinf())
    assert (lse - ref_lse)[ref_lse.isfinite()].abs().max() <= 1e-13 and (out[:, 2] == 0).all()


def test_compiled_merge_equals_eager_merge_on_views_with_masked_rows():
    """The fused (torch.compile) merge that CUDA uses gives the eager merge's results, here compiled for
    the CPU: same in-place writes into a query sub-range, -inf rows kept, bit-close (fp32 1e-6)."""
    from mcp_context.merge import compiled_merge, merge_blocks_eager_

    gen = torch.Generator().manual_seed(1)
    out, lse = torch.randn(2, 4, 64, 16, generator=gen), torch.randn(2, 4, 64, generator=gen)
    block_out, block_lse = torch.randn(2, 4, 32, 16, generator=gen), torch.randn(2, 4, 32, generator=gen)
    lse[0, 0, 10:20] = float("-inf")
    block_lse[0, 0, :5] = float("-inf")  # rows 10..14: both sides empty
    eager_out, eager_lse = out.clone(), lse.clone()
    rows = slice(10, 42)
    compiled_merge()(out[:, :, rows], lse[:, :, rows], out[:, :, rows], lse[:, :, rows], block_out, block_lse)
    merge_blocks_eager_(eager_out[:, :, rows], eager_lse[:, :, rows], eager_out[:, :, rows], eager_lse[:, :, rows],
                        block_out, block_lse)
    assert torch.isfinite(out).all() and (lse[0, 0, 10:15] == float("-inf")).all()
    assert torch.allclose(out, eager_out, atol=1e-6, rtol=1e-6)
    assert torch.equal(lse.isinf(), eager_lse.isinf())
    finite = lse.isfinite()
    assert torch.allclose(lse[finite], eager_lse[finite], atol=1e-6, rtol=1e-6)


def test_blocks_merged_into_a_half_result_round_once():
    """``merge_blocks_`` of two bf16 blocks written straight into bf16 rows (one of them the first block's own
    rows, overwritten in place: a held block) is the fp32 merge rounded once, bit for bit, and its lse the
    fp32 one; a later block merged through an fp32 accumulator and written by the last merge (from the
    accumulator) equals three blocks merged in fp32 then rounded once; and four held blocks merged at once into
    the first one's rows equal them merged in fp32 one by one, rounded once (within one bf16 rounding: the
    weights are summed in another order)."""

    g = torch.Generator().manual_seed(2)
    blocks = [(torch.randn(1, 2, 8, 4, generator=g).bfloat16(), torch.randn(1, 2, 8, generator=g) * 3)
              for _ in range(3)]
    ref_out, ref_lse = blocks[0][0].float(), blocks[0][1].clone()
    for o, l in blocks[1:2]:
        merge_(ref_out, ref_lse, o, l)
    held, held_lse = blocks[0][0].clone(), blocks[0][1].clone()
    merge_blocks_(held, held_lse, held, held_lse, *blocks[1])  # two blocks: into the first's own rows
    assert torch.equal(held, ref_out.bfloat16()) and torch.equal(held_lse, ref_lse)
    acc, acc_lse = torch.empty(1, 2, 8, 4), torch.empty(1, 2, 8)
    merge_blocks_(acc, acc_lse, *blocks[0], *blocks[1])  # three: the first pair into fp32
    result = torch.empty(1, 2, 8, 4, dtype=torch.bfloat16)
    merge_blocks_(result, acc_lse, acc, acc_lse, *blocks[2])  # the last: fp32 sum + block, rounded once
    merge_(ref_out, ref_lse, *blocks[2])
    assert torch.equal(result, ref_out.bfloat16()) and torch.allclose(acc_lse, ref_lse, atol=0, rtol=1e-6)
    four = blocks + [(torch.randn(1, 2, 8, 4, generator=g).bfloat16(), torch.randn(1, 2, 8, generator=g) * 3)]
    ref_out, ref_lse = four[0][0].float(), four[0][1].clone()
    for o, l in four[1:]:
        merge_(ref_out, ref_lse, o, l)
    held, held_lse = four[0][0].clone(), four[0][1].clone()
    merge_blocks_(held, held_lse, held, held_lse, *(x for block in four[1:] for x in block))
    assert (held.float() - ref_out).abs().max() <= 2 ** -8 * ref_out.abs().max()
    assert torch.allclose(held_lse, ref_lse, atol=0, rtol=1e-6)


def test_add_blocks_sums_in_fp32_and_rounds_once():
    """``add_blocks_``: two bf16 dQ blocks into bf16 (or an fp32 sum plus a bf16 block, or four blocks at once)
    equal adding them in fp32 and casting once, bit for bit, also into a strided view."""
    from mcp_context.merge import add_blocks_

    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(1, 2, 8, 4, generator=g).bfloat16() for _ in range(3))
    out = torch.zeros(1, 2, 16, 4, dtype=torch.bfloat16)
    add_blocks_(out[:, :, 4:12], a, b)
    assert torch.equal(out[:, :, 4:12], (a.float() + b.float()).bfloat16()) and (out[:, :, :4] == 0).all()
    acc = torch.empty(1, 2, 8, 4)
    add_blocks_(acc, a, b)
    add_blocks_(out[:, :, 4:12], acc, c)
    assert torch.equal(out[:, :, 4:12], (a.float() + b.float() + c.float()).bfloat16())
    d = torch.randn(1, 2, 8, 4, generator=g).bfloat16()
    held = a.clone()
    add_blocks_(held, held, b, c, d)  # into the first block's own rows
    assert torch.equal(held, (a.float() + b.float() + c.float() + d.float()).bfloat16())


def test_a_first_write_of_dk_dv_equals_adding_them_to_zeros():
    """``copy_kv_`` (a member's own dK/dV sum, started by a block over every row) leaves the packed fp32
    accumulator exactly as a zero fill then ``add_kv_`` did, MLA head dims (dqk 12, dv 6), bf16 blocks."""
    from mcp_context.merge import add_kv_, copy_kv_

    g = torch.Generator().manual_seed(0)
    dk, dv = torch.randn(1, 2, 8, 12, generator=g).bfloat16(), torch.randn(1, 2, 8, 6, generator=g).bfloat16()
    added = torch.zeros(1, 2, 8, 18)
    add_kv_(added, dk, dv)
    written = torch.full((1, 2, 8, 18), float("nan"))  # unwritten memory: every element must be overwritten
    copy_kv_(written, dk, dv)
    assert torch.equal(written, added)


@pytest.mark.parametrize("held", [0, 3])
def test_compiled_folds_equal_their_eager_forms_into_a_half_result(held):
    """The last merge and the last dQ add of an fp32 sum (fp32 ``a``, bf16 ``out``), with ``held`` held blocks
    beside the block, compiled as CUDA runs them (here for the CPU), give the eager forms' bf16 results;
    compiled, ``a`` is left as it was (eagerly it is used as the scratch, which the executor allows: its rows
    are not read again)."""
    from mcp_context.merge import add_blocks_eager_, merge_blocks_eager_

    g = torch.Generator().manual_seed(4)
    acc, acc_lse = torch.randn(1, 2, 16, 8, generator=g), torch.randn(1, 2, 16, generator=g)
    blocks = [(torch.randn(1, 2, 16, 8, generator=g).bfloat16(), torch.randn(1, 2, 16, generator=g))
              for _ in range(held + 1)]
    flat = [x for block in blocks for x in block]
    kept = acc.clone()
    out, lse = torch.empty(1, 2, 16, 8, dtype=torch.bfloat16), acc_lse.clone()
    torch.compile(merge_blocks_eager_, fullgraph=True)(out, lse, acc, lse, *flat)
    assert torch.equal(acc, kept)
    eager_out, eager_lse = torch.empty_like(out), acc_lse.clone()
    merge_blocks_eager_(eager_out, eager_lse, acc.clone(), eager_lse, *flat)
    assert torch.allclose(out.float(), eager_out.float(), atol=0, rtol=2 ** -7) and torch.allclose(lse, eager_lse)
    dq = torch.empty(1, 2, 16, 8, dtype=torch.bfloat16)
    torch.compile(add_blocks_eager_, fullgraph=True)(dq, acc, *flat[0::2])
    assert torch.equal(acc, kept) and torch.equal(dq, sum((b.float() for b in flat[0::2]), acc).bfloat16())


def _double_add_(out, a, b):
    torch.ops.aten.copy_(out, a + 2 * b)


def test_a_fused_region_compiles_past_torchs_recompile_limit():
    """A process that meets more operand variants than torch's limit of 8 per function (a test run, a
    benchmark over a grid: dtypes, head counts, aliasing) keeps every variant compiled: a ``fullgraph``
    region raises ``FailOnRecompileLimitHit`` at the 9th, which made every later call of the process eager.
    Here 12 variants (4 dtypes x 3 ranks), compiled by dynamo with its eager backend (the limit is
    dynamo's, whatever the backend), each giving the eager result."""
    from mcp_context import regions

    fused = regions.Region(_double_add_, "test region")
    fused.backend = "eager"
    assert torch._dynamo.config.recompile_limit < 12 <= regions.RECOMPILE_LIMIT
    try:
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            for shape in ((5,), (3, 5), (2, 3, 5)):
                a, b = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
                out = torch.empty_like(a)
                fused.run_compiled(out, a, b)
                assert torch.equal(out, a + 2 * b), (dtype, shape)
    finally:
        torch._dynamo.reset()
    assert fused.error is None
