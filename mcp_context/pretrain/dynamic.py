"""One step of dynamic context parallelism: each document over the group of ranks its length needs.

Every rank of the data x context parallel group holds the step's documents, makes the same plan from
their lengths (``megatron.dynamic_plan.plan_sub_samples``), checks that every rank made it and that it
cannot deadlock (``megatron.dynamic_schedule``) before any collective, then runs its own documents in
the plan's order: each sliced zigzag over its group by megatron-core's
``get_batch_on_this_hybrid_cp_rank`` and run with the ``PackedSeqParams(local_cp_size, cp_group)`` it
makes, which our core attention turns into that group's engine. Each document's backward runs right
after its forward, so a rank holds one document's activations at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mcp_context.megatron.dynamic_plan import Plan, plan_sub_samples
from mcp_context.megatron.dynamic_schedule import agree_on_schedule, check_runs_in_order


@dataclass
class SubSampleLoss:
    """What one document left on this rank: its id, the positions this rank held, their per-token losses
    (detached) and the size of the group that ran it."""

    doc: int
    positions: torch.Tensor
    per_token: torch.Tensor
    group_size: int


def agreed_plan(lengths: Sequence[int], budget: int, sizes: Sequence[int], world_group: ProcessGroup) -> Plan:
    """The step's plan, made here and checked against every other rank's before any collective uses it."""
    plan = plan_sub_samples(lengths, budget, sizes, dist.get_world_size(world_group))
    agree_on_schedule(plan, dict(enumerate(int(n) for n in lengths)), world_group)
    check_runs_in_order(plan)
    return plan


def run_plan(model, documents: Sequence[dict], plan: Plan, groups: dict[int, ProcessGroup],
             world_group: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, list[SubSampleLoss]]:
    """Forward and backward of this rank's documents (``tokens``, ``labels``, ``loss_mask``, ``position_ids``,
    each ``[s]``) in the plan's order; the sum of their masked per-token losses, their valid tokens, and
    what each left (``groups``: ``build_sub_groups``'s)."""
    from megatron.core.utils import get_batch_on_this_hybrid_cp_rank

    me = dist.get_rank(world_group)
    counts: dict[int, int] = {}
    for ids in plan[0]:
        for sid in ids:
            counts[sid] = counts.get(sid, 0) + 1
    loss_sum, num_tokens, left = torch.zeros(()), torch.zeros(()), []
    for sid in plan[0][me]:
        n = counts[sid]
        batch, params = get_batch_on_this_hybrid_cp_rank(dict(documents[sid]), n, cp_group=groups.get(n) if n > 1
                                                         else None)
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                          packed_seq_params=params)
        mask = batch["loss_mask"].float()
        total = (per_token.float() * mask).sum()
        total.backward()
        loss_sum, num_tokens = loss_sum + total.detach().cpu(), num_tokens + mask.sum().cpu()
        left.append(SubSampleLoss(sid, batch["position_ids"][0].cpu(), per_token.detach()[0].cpu(), n))
    return loss_sum, num_tokens, left
