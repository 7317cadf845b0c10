"""One step of dynamic context parallelism: each document over the group of ranks its length needs.

Every rank of the data x context parallel group holds the step's documents, makes the same plan from
their lengths (``megatron.dynamic_plan.plan_sub_samples``), checks that every rank made it and that it
cannot deadlock (``megatron.dynamic_schedule``) before any collective, then runs its own documents in
the plan's order: each sliced zigzag over its group by megatron-core's
``get_batch_on_this_hybrid_cp_rank`` and run with the ``PackedSeqParams(local_cp_size, cp_group)`` it
makes, which our core attention turns into that group's engine. Each document's backward runs right
after its forward, so a rank holds one document's activations at a time.

In the pretrain loop (``model.hybrid_context_parallel``), every rank reads the whole global batch, splits
its samples into documents at the end-of-document tokens (``step_documents``) and runs the step's plan
(``step_loss_sums``); the groups are made once at start-up (``start_dynamic_cp``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mcp_context.cp_rules import dynamic_cp_sizes, dynamic_document_multiple
from mcp_context.data.documents import document_offsets
from mcp_context.megatron.dynamic_groups import build_sub_groups
from mcp_context.megatron.dynamic_plan import Plan, plan_sub_samples
from mcp_context.megatron.dynamic_schedule import agree_on_schedule, check_runs_in_order
from mcp_context.recipes import RecipeConfig


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
             world_group: ProcessGroup, backward: bool = True) -> tuple[torch.Tensor, torch.Tensor, list[SubSampleLoss]]:
    """Forward (and, with ``backward``, backward) of this rank's documents (``tokens``, ``labels``, ``loss_mask``,
    ``position_ids``, each ``[s]``) in the plan's order; the sum of their masked per-token losses, their valid
    tokens, and what each left (``groups``: ``build_sub_groups``'s)."""
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
        if backward:
            total.backward()
        loss_sum, num_tokens = loss_sum + total.detach().cpu(), num_tokens + mask.sum().cpu()
        left.append(SubSampleLoss(sid, batch["position_ids"][0].cpu(), per_token.detach()[0].cpu(), n))
    return loss_sum, num_tokens, left


@dataclass(frozen=True)
class DynamicCP:
    """What a dynamic-CP run keeps from start-up: the data parallel group its documents spread over, the group
    sizes the hierarchy can cut, this rank's group of each size, the per-rank budget, the padding multiple and
    the end-of-document token the samples are split at."""

    world_group: ProcessGroup
    sizes: tuple[int, ...]
    groups: dict[int, ProcessGroup]
    budget: int
    multiple: int
    eod: int


def start_dynamic_cp(cfg: RecipeConfig, eod: int) -> DynamicCP:
    """The groups of ``model.hybrid_context_parallel`` (collective: every rank, once, after ``parallel_state``)."""
    from megatron.core import parallel_state

    world_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    world = dist.get_world_size(world_group)
    levels = cfg.model.hierarchical_context_parallel_sizes
    sizes = tuple(dynamic_cp_sizes(world, levels[0] if levels else world))
    return DynamicCP(world_group, sizes, build_sub_groups(world_group, sizes), cfg.model.max_seqlen_per_dp_cp_rank,
                     dynamic_document_multiple(world), eod)


def step_documents(micro_batches: Sequence[dict], eod: int, multiple: int) -> list[dict]:
    """The documents of a global batch's samples (in order), each ending at an ``eod`` token or its sample's end
    and padded to a multiple of ``multiple`` with token, label, position and loss mask 0 (so no real token sees
    the padding); positions are the dataset's, as in ``packing``."""
    documents = []
    for micro_batch in micro_batches:
        for b in range(micro_batch["tokens"].shape[0]):
            cu, padded = document_offsets(micro_batch["tokens"][b], eod, multiple)
            for i in range(len(cu) - 1):
                start, end, size = cu[i], cu[i + 1], padded[i + 1] - padded[i]
                documents.append({key: torch.nn.functional.pad(micro_batch[key][b, start:end], (0, size - end + start))
                                  for key in ("tokens", "labels", "loss_mask", "position_ids")})
    return documents


def step_loss_sums(model, micro_batches: Sequence[dict], dynamic: DynamicCP, device: torch.device,
                   backward: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a global batch under dynamic CP (every rank holds all of ``micro_batches``): the sum
    of its per-token losses and its valid tokens, after the forward (and backward) of its documents."""
    documents = [{key: value.to(device) for key, value in doc.items()}
                 for doc in step_documents(micro_batches, dynamic.eod, dynamic.multiple)]
    plan = agreed_plan([int(doc["tokens"].numel()) for doc in documents], dynamic.budget, dynamic.sizes,
                       dynamic.world_group)
    loss_sum, num_tokens, _ = run_plan(model, documents, plan, dynamic.groups, dynamic.world_group, backward)
    return loss_sum.to(device), num_tokens.to(device)
