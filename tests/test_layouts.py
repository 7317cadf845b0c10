"""Layouts: zigzag equals megatron-core's own CP slicing; shard/unshard round trips; clear errors."""
import pytest
import torch

from mcp_context import shard_positions, shard_sequence, unshard_sequence
from tests._dist import run_distributed


def _megatron_zigzag(rank, world):
    from megatron.core.utils import get_batch_on_this_cp_rank
    import torch.distributed as dist

    tokens = torch.arange(3 * 40).reshape(3, 40)  # [b, s]
    ours = shard_sequence(tokens, world, rank, "zigzag", dim=1)
    theirs = get_batch_on_this_cp_rank({"tokens": tokens.clone()}, cp_group=dist.group.WORLD)["tokens"]
    return torch.equal(ours, theirs)


def test_zigzag_is_megatron_get_batch_on_this_cp_rank():
    assert all(run_distributed(4, _megatron_zigzag))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_shards_partition_the_sequence_and_round_trip(layout, cp):
    x = torch.randn(16 * cp, 3, 5)
    shards = [shard_sequence(x, cp, r, layout) for r in range(cp)]
    assert torch.equal(unshard_sequence(shards, layout), x)
    positions = torch.cat([shard_positions(16 * cp, cp, r, layout) for r in range(cp)])
    assert torch.equal(positions.sort().values, torch.arange(16 * cp))
    for r in range(cp):  # position ids follow the tokens
        assert torch.equal(shards[r], x[shard_positions(16 * cp, cp, r, layout)])


def test_zigzag_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert shard_positions(16, 4, 1, "zigzag").tolist() == [2, 3, 12, 13]
    assert shard_positions(8, 2, 1, "striped").tolist() == [1, 3, 5, 7]


def test_indivisible_sequence_names_the_padded_length():
    with pytest.raises(ValueError, match=r"sequence length 1001 is not divisible by 2\*cp=8 for layout 'zigzag'; pad to 1008"):
        shard_sequence(torch.zeros(1001, 2), 4, 0, "zigzag")
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by cp=4 for layout 'striped'; pad to 12"):
        shard_sequence(torch.zeros(10), 4, 0, "striped")
    with pytest.raises(ValueError, match=r"layout='ring' is not known; choose one of contiguous, zigzag, striped"):
        shard_sequence(torch.zeros(8), 2, 0, "ring")


def test_the_packed_work_prefix_is_the_sum_of_every_rows_keys():
    """``layouts.work_prefix`` (the balanced layout's causal work, computed per document) against the row-by-row
    sum: row ``o`` of a document sees ``o + 1`` keys, padding rows none; empty documents included."""
    import random

    from mcp_context.layouts import work_prefix

    rng = random.Random(0)
    for _ in range(50):
        padded = [rng.choice([0, 1, 2, 7, 16, 33]) for _ in range(rng.randint(1, 12))]
        lengths = tuple(rng.randint(0, n) for n in padded)
        starts = tuple([0] + torch.tensor(padded).cumsum(0).tolist())
        per_row = [0] * starts[-1]
        for start, n in zip(starts, lengths):
            per_row[start:start + n] = range(1, n + 1)
        prefix = work_prefix(starts, lengths)
        assert [prefix(row) for row in range(starts[-1] + 1)] == [sum(per_row[:row]) for row in range(starts[-1] + 1)]


def test_a_packings_balanced_spans_are_placed_once_for_all_ranks_and_calls(monkeypatch):
    """A packed batch's spans are asked for by every rank of its scheme and for every tensor sharded: the placement
    runs once per packing (``layouts.PACKINGS_KEPT`` kept), and a new packing is placed afresh."""
    from mcp_context import layouts
    from mcp_context.schedule import forget_kept_schedules

    forget_kept_schedules()
    placed = []
    place = layouts._balanced_ranges
    monkeypatch.setattr(layouts, "_balanced_ranges", lambda *args: placed.append(args) or place(*args))
    cu = torch.tensor([0, 40, 41, 100, 128])
    shards = [shard_sequence(torch.arange(128), 4, r, "balanced", cu_seqlens=cu) for r in range(4)]
    shards += [shard_positions(128, 4, r, "balanced", cu_seqlens=cu) for r in range(4)]
    assert len(placed) == 1
    assert torch.equal(torch.cat(shards[:4]).sort().values, torch.arange(128))
    shard_sequence(torch.arange(128), 4, 0, "balanced", cu_seqlens=torch.tensor([0, 64, 128]))
    assert len(placed) == 2
    forget_kept_schedules()
