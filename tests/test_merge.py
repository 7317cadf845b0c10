"""Online-softmax merge: exact against one softmax over the union of keys; -inf rows stay finite."""
import torch

from mcp_context.merge import merge_


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


def test_compiled_merge_equals_eager_merge_on_views_with_masked_rows():
    """The fused (torch.compile) merge that CUDA uses gives the eager merge's results, here compiled for
    the CPU: same in-place writes into a query sub-range, -inf rows kept, bit-close (fp32 1e-6)."""
    from mcp_context.merge import compiled_merge, merge_eager_

    gen = torch.Generator().manual_seed(1)
    out, lse = torch.randn(2, 4, 64, 16, generator=gen), torch.randn(2, 4, 64, generator=gen)
    block_out, block_lse = torch.randn(2, 4, 32, 16, generator=gen), torch.randn(2, 4, 32, generator=gen)
    lse[0, 0, 10:20] = float("-inf")
    block_lse[0, 0, :5] = float("-inf")  # rows 10..14: both sides empty
    eager_out, eager_lse = out.clone(), lse.clone()
    compiled_merge()(out[:, :, 10:42], lse[:, :, 10:42], block_out, block_lse)
    merge_eager_(eager_out[:, :, 10:42], eager_lse[:, :, 10:42], block_out, block_lse)
    assert torch.isfinite(out).all() and (lse[0, 0, 10:15] == float("-inf")).all()
    assert torch.allclose(out, eager_out, atol=1e-6, rtol=1e-6)
    assert torch.equal(lse.isinf(), eager_lse.isinf())
    finite = lse.isfinite()
    assert torch.allclose(lse[finite], eager_lse[finite], atol=1e-6, rtol=1e-6)


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
