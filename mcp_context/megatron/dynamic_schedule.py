"""Dynamic CP's schedule, agreed by every rank before any sub-sample's collective.

Under megatron-core's ``hybrid_context_parallel`` every rank makes each step's schedule itself
(``BalancedCPScheduler`` over the gathered sub-sample lengths): which sub-samples run, in which groups of
ranks, in which order. A rank whose schedule differed would join another collective than its partners
and the step would hang. ``agree_on_schedule`` checks once per step, as packings are checked
(``engine.agree_on_documents``): one all-reduce of a digest over the data x context parallel group; ranks
that differ all raise the same ValueError naming the ranks and the first sub-sample they differ on.
``check_runs_in_order`` proves, with no communication, that the agreed schedule cannot deadlock (every
pair of ranks meets their shared sub-samples in the same order). ``AgreedScheduler`` wraps megatron-core's
scheduler so both run where the schedule is made, before the data is rerouted and before any attention,
and refuses first a sub-sample that no group can hold (megatron-core's scheduler would loop forever).
"""
from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..cp_rules import check_sub_sample_fits

# A step's schedule, megatron-core's form: schedule[j][r] = the sub-sample ids rank r runs in group j, in order.
Schedule = Sequence[Sequence[Sequence[int]]]


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little")


def _members(schedule: Schedule) -> dict[tuple[int, int], list[int]]:
    """(group, sub-sample id) -> the ranks that run it, in rank order."""
    members: dict[tuple[int, int], list[int]] = {}
    for j, per_rank in enumerate(schedule):
        for r, ids in enumerate(per_rank):
            for sid in ids:
                members.setdefault((j, int(sid)), []).append(r)
    return members


def _rows(schedule: Schedule, seqlens: dict[int, int]) -> list[tuple[int, ...]]:
    """One row per sub-sample and group: (group, id, length, its ranks as a bit mask (-count past 62 ranks),
    digest of each rank's position of it in its queue), sorted by (group, id)."""
    rows = []
    for (j, sid), ranks in sorted(_members(schedule).items()):
        place = tuple((r, [int(x) for x in schedule[j][r]].index(sid)) for r in ranks)
        mask = sum(1 << r for r in ranks) if max(ranks) < 62 else -len(ranks)
        rows.append((j, sid, int(seqlens[sid]), mask, _digest(place)))
    return rows


def agree_on_schedule(schedule: Schedule, seqlens: dict[int, int], group: ProcessGroup) -> None:
    """Check that every rank of ``group`` holds the same schedule and lengths (one all-reduce of a digest);
    ranks that differ all raise the same ValueError naming them and the first sub-sample they differ on."""
    rows = _rows(schedule, seqlens)
    digest = _digest(rows)
    extremes = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if extremes.tolist() == [digest, -digest]:
        return
    # Every rank took this branch (the extremes are the same everywhere): gather the rows to name the difference.
    world = dist.get_world_size(group)
    count = torch.tensor([len(rows)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    mine = torch.full((int(count), 5), -1, dtype=torch.int64)
    if rows:
        mine[:len(rows)] = torch.tensor(rows, dtype=torch.int64)
    every = mine.new_empty(world * mine.numel())
    dist.all_gather_into_tensor(every, mine.reshape(-1), group=group)
    views = [tuple(map(tuple, v)) for v in every.view(world, -1, 5).tolist()]
    usual = Counter(views).most_common(1)[0][0]
    odd = [r for r, v in enumerate(views) if v != usual]
    first = min(i for r in odd for i, (a, b) in enumerate(zip(views[r], usual)) if a != b)
    theirs = "; ".join(f"rank {r}: {_describe(views[r][first])}" for r in odd)
    raise ValueError(f"ranks {odd} disagree with the other ranks on the dynamic-CP schedule at its sub-sample #{first} "
                     f"(the others: {_describe(usual[first])}; {theirs}); every rank must make the same schedule "
                     f"from the same gathered lengths (same max_seqlen_per_dp_cp_rank, scheduler and data order)")


def _describe(row: tuple[int, ...]) -> str:
    j, sid, length, mask, _ = row
    ranks = f"{-mask} ranks" if mask < 0 else f"ranks {[r for r in range(mask.bit_length()) if mask >> r & 1]}"
    return "nothing" if j < 0 else f"sub-sample {sid} ({length} tokens) in group {j} on {ranks}"


def check_runs_in_order(schedule: Schedule) -> None:
    """A ValueError when the schedule can deadlock: each rank runs its sub-samples in order, group by group,
    and a sub-sample starts only when it is next on every one of its ranks; this replays that and names
    the ranks left waiting on each other."""
    world = max((len(per_rank) for per_rank in schedule), default=0)
    queues = [[(j, int(sid)) for j, per_rank in enumerate(schedule) if r < len(per_rank) for sid in per_rank[r]]
              for r in range(world)]
    members = _members(schedule)
    heads = [0] * world
    progress = True
    while progress:
        progress = False
        for key, ranks in members.items():
            if all(heads[r] < len(queues[r]) and queues[r][heads[r]] == key for r in ranks):
                for r in ranks:
                    heads[r] += 1
                progress = True
    stuck = {r: queues[r][heads[r]] for r in range(world) if heads[r] < len(queues[r])}
    if stuck:
        raise ValueError("the dynamic-CP schedule deadlocks: " + "; ".join(
            f"rank {r} waits in group {j} for sub-sample {sid} with ranks {members[(j, sid)]}"
            for r, (j, sid) in sorted(stuck.items())) + "; ranks that share two sub-samples must run them in the "
            "same order")


class AgreedScheduler:
    """megatron-core's ``BalancedCPScheduler`` whose schedules are checked before anything uses them: every
    sub-sample fits the largest group, every rank made the same schedule, and it runs without deadlock."""

    def __init__(self, scheduler: Any, group: ProcessGroup, budget: int):
        self.scheduler, self.group, self.budget = scheduler, group, budget
        self.world = dist.get_world_size(group)

    def get_groups_and_subsamples(self, sample_id_seqlens: Sequence[tuple[int, int]], config: Any):
        for sid, length in sample_id_seqlens:
            check_sub_sample_fits(int(length), self.budget, self.world, what=f"sub-sample {sid}")
        groups, sample_id_groups = self.scheduler.get_groups_and_subsamples(sample_id_seqlens, config)
        agree_on_schedule(sample_id_groups, {int(s): int(n) for s, n in sample_id_seqlens}, self.group)
        check_runs_in_order(sample_id_groups)
        return groups, sample_id_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


def agreed_hybrid_cp_loader(loader: Any) -> Any:
    """megatron-core's ``HybridCPDataLoaderWrapper`` with its scheduler wrapped in ``AgreedScheduler``."""
    loader.cp_balancing_scheduler = AgreedScheduler(loader.cp_balancing_scheduler, loader.dp_cp_group,
                                                    loader.config.max_seqlen_per_dp_cp_rank)
    return loader
