"""Our own dynamic-CP plan: which ranks run each sub-sample of a step, made the same on every rank.

Where megatron-core's ``BalancedCPScheduler`` gives each sub-sample a power of two of ranks, this plan
takes any group size ``cp_rules.dynamic_cp_sizes`` allows (a divisor of the data x context parallel
world that the hierarchy can cut), the smallest that holds the sub-sample within the per-rank token
budget, on the aligned run of adjacent ranks with the least work so far (work ~ length² / ranks, as
megatron-core estimates it). Every rank runs its sub-samples in one global order (longest first), so
two ranks that share two sub-samples meet them in the same order and the plan cannot deadlock
(``dynamic_schedule.check_runs_in_order`` replays it). It is a pure function of the lengths: every rank
computes it from the same step data, and ``dynamic_schedule.agree_on_schedule`` checks that they did.
``dynamic_groups.build_sub_groups`` makes, once at start-up, the process groups the plan's sizes need.
"""
from __future__ import annotations

from typing import Sequence

from ..cp_rules import dynamic_cp_size

# schedule[0][r]: the sub-sample ids rank r runs, in order (megatron-core's form, one round)
Plan = list[list[list[int]]]


def plan_sub_samples(lengths: Sequence[int], budget: int, sizes: Sequence[int], world: int) -> Plan:
    """Each sub-sample ``i`` (``lengths[i]`` tokens) on the smallest allowed group of adjacent, aligned ranks
    that holds it at ``budget`` tokens a rank, the least-loaded such run; longest sub-samples first."""
    queues: list[list[int]] = [[] for _ in range(world)]
    load = [0.0] * world
    for sid in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = dynamic_cp_size(int(lengths[sid]), budget, sizes, what=f"sub-sample {sid}")
        start = min(range(0, world, n), key=lambda s: (max(load[s:s + n]), s))
        for r in range(start, start + n):
            queues[r].append(sid)
            load[r] += lengths[sid] ** 2 / n
    return [queues]
