"""The schedule covers exactly the visible pairs, and its balance and waste figures are right."""
import dataclasses

import pytest
import torch

from mcp_context.layouts import spans_positions
from mcp_context.masks import CAUSAL, FULL
from mcp_context.schedule import layout_schedule, load_balance, masked_waste


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("cp,inner", [(1, 1), (2, 1), (4, 1), (4, 2), (8, 2), (8, 4), (8, 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_tasks_cover_every_visible_pair_exactly_once(layout, cp, inner, causal):
    sch = layout_schedule(layout, cp, 12 * cp, CAUSAL if causal else FULL, inner)
    for m in range(sch.ring_size):
        q_pos = spans_positions(sch.member_spans[m])
        for step in range(sch.ring_size):
            k_pos = spans_positions(sch.member_spans[sch.kv_source(m, step)])
            visible = (k_pos[None, :] <= q_pos[:, None]) if causal else torch.ones(len(q_pos), len(k_pos), dtype=bool)
            covered = torch.zeros(visible.shape, dtype=torch.int)
            for t in sch.tasks[m][step]:
                covered[t.q[0]:t.q[1], t.kv[0]:t.kv[1]] += t.mask.visible(t.q[1] - t.q[0], t.kv[1] - t.kv[0]).int()
            assert torch.equal(covered, visible.int()), (m, step, sch.tasks[m][step])


@pytest.mark.parametrize("cp", [2, 4, 8, 16])
def test_zigzag_is_perfectly_balanced_and_contiguous_is_not(cp):
    chunk = 64
    assert load_balance(layout_schedule("zigzag", cp, 2 * cp * chunk, CAUSAL)) == 1.0
    n = 2 * chunk  # contiguous: rank P-1 does a causal block plus P-1 full blocks
    expected = (n * (n + 1) / 2 + (cp - 1) * n * n) / (n * (n + 1) / 2 + (cp - 1) / 2 * n * n)
    got = load_balance(layout_schedule("contiguous", cp, cp * n, CAUSAL))
    assert got == pytest.approx(expected, rel=1e-12) and got == pytest.approx((2 * cp - 1) / cp, rel=0.01)


def test_zigzag_off_diagonal_steps_are_half_blocks():
    sch = layout_schedule("zigzag", 4, 64, CAUSAL)  # local 16 rows = two chunks of 8
    for rank in range(4):
        for step in range(1, 4):
            (task,) = sch.tasks[rank][step]
            assert not task.causal and task.useful_pairs == 16 * 8


def test_masked_waste_is_only_inside_diagonal_tiles():
    cp, n, tile = 8, 2048, 128  # each rank: one causal 2048-row diagonal block (two zigzag chunks)
    seq = cp * n
    sch = layout_schedule("zigzag", cp, seq, CAUSAL)
    assert masked_waste(sch, tile=1) == 0.0
    computed_diagonal = sum(tile * min(a + tile, n) for a in range(0, n, tile))
    expected = cp * (computed_diagonal - n * (n + 1) // 2) / (seq * (seq + 1) // 2)
    assert masked_waste(sch, tile=tile) == pytest.approx(expected, rel=1e-12)
    assert 0 < expected < 0.01


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped"])
def test_attention_flops_sum_to_the_causal_total(layout):
    """4*d FLOPs (QK^T and PV) per visible pair and head; the ranks together do exactly S(S+1)/2 pairs."""
    from mcp_context.schedule import attention_flops

    seq, batch, heads, head_dim = 8 * 64, 2, 8, 16
    flops = attention_flops(layout_schedule(layout, 8, seq, CAUSAL), batch, heads, head_dim)
    assert sum(flops) == 4 * head_dim * batch * heads * seq * (seq + 1) // 2
    if layout == "zigzag":
        assert len(set(flops)) == 1


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp,inner", [(2, 1), (4, 1), (8, 1), (8, 2), (16, 4)])
@pytest.mark.parametrize("mask", ["causal", "full", "window"])
def test_gathered_tasks_cover_every_visible_pair_once_in_a_few_calls(layout, cp, inner, mask):
    """An all-gather member's plan against the whole sequence in position order covers exactly the pairs it
    sees, and a causal zigzag shard needs at most 4 calls (a full block and a causal square per chunk) for
    any ring size, where the ring makes one per step."""
    from mcp_context.masks import attention_mask
    from mcp_context.schedule import gathered_tasks, position_pieces

    seq = 16 * cp
    value = {"causal": CAUSAL, "full": FULL, "window": attention_mask(True, (5, 0))}[mask]
    sch = layout_schedule(layout, cp, seq, value, inner)
    order = position_pieces(sch)
    gathered_rows = torch.cat([spans_positions(spans) for spans in sch.member_spans])
    assert torch.equal(torch.cat([gathered_rows[a:a + n] for a, n in order]), torch.arange(seq))
    k_pos = torch.arange(seq)
    for m in range(sch.ring_size):
        q_pos = spans_positions(sch.member_spans[m])
        diff = k_pos[None, :] - q_pos[:, None]
        visible = {"causal": diff <= 0, "full": torch.ones_like(diff, dtype=bool), "window": (diff <= 0) & (diff >= -5)}[mask]
        covered = torch.zeros(visible.shape, dtype=torch.int)
        (tasks,) = gathered_tasks(sch, m)
        for t in tasks:
            covered[t.q[0]:t.q[1], t.kv[0]:t.kv[1]] += t.mask.visible(t.q[1] - t.q[0], t.kv[1] - t.kv[0]).int()
        assert torch.equal(covered, visible.int()), (m, tasks)
        if mask == "causal" and layout == "zigzag":
            assert len(tasks) <= 4, tasks


def test_striped_shards_have_no_position_order_of_runs():
    from mcp_context.schedule import position_pieces

    assert position_pieces(layout_schedule("striped", 4, 64, CAUSAL)) is None


def test_take_rows_reorders_runs_and_its_gradient_is_the_inverse_reorder():
    """The all-to-all's and the all-gather's reorder: forward a concatenation of row runs, backward the
    concatenation that puts them back (what slicing's autograd gives, without a zero-filled gradient per run)."""
    from mcp_context.algorithms.schemes import take_rows

    x = torch.randn(10, 2, 3, dtype=torch.float64, requires_grad=True)
    pieces = [(6, 4), (0, 2), (2, 4)]
    y = take_rows(x, pieces)
    assert torch.equal(y, torch.cat([x[6:10], x[0:2], x[2:6]]))
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    ref = torch.autograd.grad(torch.cat([x[6:10], x[0:2], x[2:6]]), x, g)[0]
    assert torch.equal(dx, ref)


def test_a_schedule_is_built_once_per_arguments_and_shared():
    """``layout_schedule`` keeps its last ``SCHEDULES_KEPT`` schedules of masks without documents: equal
    arguments give the same immutable ``Schedule`` object (a planner's dry run builds the whole ring's schedule
    on every rank) and different ones do not. A packed batch's documents schedule is built each time (new
    documents every step, megabytes each), equal to a fresh build; ``forget_kept_schedules`` drops the rest."""
    from mcp_context.masks import documents_mask
    from mcp_context.schedule import _kept_schedule, forget_kept_schedules

    forget_kept_schedules()
    first = layout_schedule("zigzag", 8, 256, CAUSAL, 2)
    assert layout_schedule("zigzag", 8, 256, CAUSAL, 2) is first
    assert layout_schedule("zigzag", 8, 256, CAUSAL, 4) is not first
    assert isinstance(first.tasks, tuple) and all(isinstance(m, tuple) for m in first.tasks)
    docs = documents_mask([0, 96, 256])
    packed = layout_schedule("zigzag", 4, 256, docs)
    assert layout_schedule("zigzag", 4, 256, docs) is not packed
    assert layout_schedule("zigzag", 4, 256, dataclasses.replace(docs, agreed_in=object())) == packed
    assert _kept_schedule.cache_info().currsize == 2
    forget_kept_schedules()
    assert _kept_schedule.cache_info().currsize == 0 and layout_schedule("zigzag", 8, 256, CAUSAL, 2) == first


def test_a_packings_rows_per_document_are_derived_once_per_members_spans(monkeypatch):
    """A packed ring's schedule asks a ``Documents`` for each member's rows per document at every step, as queries
    and as keys (2 P^2 asks): they are derived once per member's spans, and the schedule is the one derived afresh
    at every ask (a new ``Documents`` of the same offsets keeps nothing of the first's)."""
    from mcp_context.masks import Documents, documents_mask

    derived = []
    derive = Documents._derive_pieces
    docs = documents_mask([0, 40, 41, 100, 200, 256])
    schedule = layout_schedule("balanced", 4, 256, docs)
    expected = schedule.tasks
    monkeypatch.setattr(Documents, "_derive_pieces", lambda self, spans: derived.append(spans) or derive(self, spans))
    fresh = documents_mask([0, 40, 41, 100, 200, 256])
    assert layout_schedule("balanced", 4, 256, fresh).tasks == expected
    assert len(derived) == 4  # one per member, of 2 * 4 * 4 asks
    for spans in schedule.member_spans:  # what is kept is what a fresh derivation gives
        assert fresh._pieces(spans) == derive(fresh, spans) and fresh._pieces(spans)


def _random_mask(rng, seq: int, cp: int):
    """A causal/full mask, a window, or random documents (padded to ``2 cp`` for zigzag) with one inside."""
    from mcp_context.masks import attention_mask, documents_mask

    window = rng.choice([None, (rng.randint(0, seq), 0), (rng.randint(0, 40), rng.randint(0, 40))])
    within = attention_mask(rng.random() < 0.8, window)
    if rng.random() < 0.5:
        return within, seq
    cu = [0, *sorted(rng.sample(range(1, seq), rng.randint(1, min(30, seq - 1)) - 1)), seq]
    padded = [0]
    for a, b in zip(cu, cu[1:]):
        padded.append(padded[-1] + (b - a) + (-(b - a) % (2 * cp)))
    return documents_mask(torch.tensor(cu), torch.tensor(padded), within=within, seq_len=padded[-1]), padded[-1]


def test_the_rows_a_step_reads_are_the_same_whether_or_not_its_tasks_were_cut():
    """``Schedule.kv_rows`` (what a rank asks of the other members: the halo's sends, the ring's busy steps) comes
    from the mask's rectangles without cutting a task; it equals the union of the key ranges of the tasks
    themselves, over layouts, ring sizes, all-to-all degrees, masks and kernels' block-mask kinds."""
    import random

    from mcp_context.masks import Documents
    from mcp_context.schedule import ALL_BLOCK_MASKS, merged_ranges

    rng = random.Random(0)
    kinds = [ALL_BLOCK_MASKS, frozenset({"full", "causal"}), frozenset({"full"})]
    cases = 0
    for _ in range(150):
        cp = rng.choice([2, 4, 8])
        inner = rng.choice([i for i in (1, 2, 4) if i <= cp])
        mask, seq = _random_mask(rng, 2 * cp * rng.randint(1, 24), cp)
        layout = rng.choice(["zigzag", "balanced"] if isinstance(mask, Documents) else ["zigzag", "contiguous"])
        lazy = layout_schedule(layout, cp, seq, mask, inner, rng.choice(kinds))
        lazy = dataclasses.replace(lazy)  # nothing built yet (a kept schedule may have rows)
        cut = dataclasses.replace(lazy)
        for m in range(lazy.ring_size):
            for t in range(lazy.ring_size):
                union = tuple(merged_ranges([task.kv for task in cut.tasks[m][t]]))
                assert lazy.kv_rows(m, t) == union, (layout, cp, inner, mask, m, t)
                cases += bool(union)
        size = cut.ring_size
        assert lazy.busy_steps() == [t for t in range(size) if any(cut.tasks[m][t] for m in range(size))]
        assert not lazy._rows  # answered without cutting a task
    assert cases > 500


@pytest.mark.parametrize("comm,steps_cut", [("p2p", 8), ("all_gather", 1)])
def test_a_rank_cuts_only_its_own_members_tasks_from_a_packed_batchs_schedule(monkeypatch, comm, steps_cut):
    """A packed batch's schedule is new at every step: resolving a rank's scheme cuts the tasks of its own ring
    member's steps (8 at P = 8 for the ring; one gathered step for all_gather), not the ring's 64, and the plan
    runs the tasks the whole schedule gives that member."""
    import warnings

    import mcp_context.schedule as schedule_module
    from mcp_context.algorithms.schemes import resolve_scheme
    from mcp_context.comm import build_hcp_groups
    from mcp_context.kernels.registry import get_kernel
    from mcp_context.masks import documents_mask
    from mcp_context.plan.dryrun import fake_world
    from mcp_context.schedule import gathered_tasks

    cut, step_tasks = [], schedule_module.step_tasks
    monkeypatch.setattr(schedule_module, "step_tasks", lambda *a, **k: cut.append(a) or step_tasks(*a, **k))
    docs = documents_mask([0, 300, 301, 1000, 1800, 2048])
    kernel = get_kernel("math", torch.device("cpu"), torch.float32)
    with warnings.catch_warnings(), fake_world(8, 3):
        warnings.simplefilter("ignore")
        scheme = resolve_scheme(build_hcp_groups([8]), comm, "balanced", docs, 256, 2, kernel, 0.125)
    assert len(cut) == steps_cut
    whole = layout_schedule("balanced", 8, 2048, docs)
    expected = whole.tasks[3] if comm == "p2p" else gathered_tasks(whole, 3)
    assert tuple(tuple(step) for step in scheme.plan.tasks) == expected
