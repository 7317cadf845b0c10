"""One dynamic-CP step of the model against CP = 1: ``dynamic.step``.

Under ``model.hybrid_context_parallel`` every document of a step runs over its own group of the data x
context parallel ranks (docs/dynamic_cp.md): groups of different sizes, made at start-up, in one global
order. This check runs such a step with the pretrain entry's own functions (``pretrain.dynamic``:
``step_documents`` splits and pads the documents, ``agreed_plan`` plans and has every rank agree,
``run_plan`` slices each document over its group with megatron-core's ``get_batch_on_this_hybrid_cp_rank``
and runs forward and backward) on the recipe's GPT, and compares it with the same model at CP = 1: each
document alone on one rank.

The step holds one document per group size the hierarchy can cut (``cp_rules.dynamic_cp_sizes``: 1, ...,
the whole world), each exactly as long as that many ranks hold at the budget, and two short ragged ones
(padding, loss-masked holes). The budget is the recipe's ``max_seqlen_per_dp_cp_rank``, or ``S / W``
when smaller (``S`` the test's sequence length, ``W`` the world; ``step_budget``), so that ``--seq-len``
scales the step down as it does the other checks. The model is the recipe's, cut to its first ``LAYERS`` layers, fp32, with a vocabulary of
``VOCAB`` tokens (what crosses the ranks is attention; the vocabulary does not), its groups given as a
``pg_collection`` (no ``parallel_state`` is touched). Compared on rank 0: every token's loss and every
parameter gradient summed over the ranks (what DDP's all-reduce over DP x CP does) against the CP = 1
run's, within ``LAYER_TOL * max(1, max|ref|)``, and the group sizes that ran against the ones the step was
built for.

Distributed, each rank is a process of the world; with ``--simulate`` each rank is a thread of this
process (``inprocess.run_ranks``: every collective and transfer matched between the threads, the groups
``SimGroup`` values), on the CPU.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..cp_rules import dynamic_cp_sizes, dynamic_document_multiple
from .faults import FAULTY_RANK
from .layer import LAYER_TOL, error_and_bound
from .report import CheckResult
from .setup import Setup

_SEEDED = threading.Lock()
"""Held while a model is initialised from the global seed."""

NAME = "dynamic.step"
LAYERS = 2
"""Layers of the recipe's model the step runs: the second one's input has crossed the ranks once."""
VOCAB = 128
EOD = 0


def step_budget(max_seqlen_per_dp_cp_rank: int, seq_len: int, world: int) -> int:
    """The step's tokens a rank: the recipe's budget, or ``seq_len / world`` when smaller, rounded down to a
    multiple of ``2 * world`` (every document is padded to that multiple), at least that multiple."""
    multiple = dynamic_document_multiple(world)
    return max(multiple, min(max_seqlen_per_dp_cp_rank, seq_len // world) // multiple * multiple)


def group_sizes(setup: Setup) -> list[int]:
    """The group sizes the setup's hierarchy can cut from its world (all-to-all domains of ``sizes[0]``)."""
    return dynamic_cp_sizes(setup.cp_size, setup.sizes[0] if len(setup.sizes) > 1 else setup.cp_size)


def step_lengths(budget: int, sizes: list[int]) -> list[int]:
    """One document per group size, as long as that many ranks hold (longest first), and two short ragged ones."""
    return [n * budget for n in reversed(sizes)] + [budget // 2 + 1, budget // 4 + 3]


def planned_sizes(sizes: list[int], rank: int, fault: Optional[str]) -> list[int]:
    """The group sizes this rank plans with: ``sizes``, or under 'dynamic-group-moved' on ``FAULTY_RANK``
    without one-rank groups (a short document lands in a group of several ranks there)."""
    if fault == "dynamic-group-moved" and rank == FAULTY_RANK:
        return [n for n in sizes if n != 1]
    return sizes


def step_documents_of(setup: Setup, lengths: list[int]) -> list[dict]:
    """The step's documents as ``pretrain.dynamic.step_documents`` makes them: one seeded row per document
    ending at an end-of-document token, a loss-masked hole every 7 tokens, padded to ``2 * world`` tokens;
    positions from 0 through the padding (so that a rank's positions say which rows it held)."""
    from ..pretrain.dynamic import step_documents

    gen = torch.Generator().manual_seed(setup.seed + 23)
    rows = []
    for n in lengths:
        tokens = torch.randint(1, VOCAB, (1, n), generator=gen)
        tokens[0, -1] = EOD
        positions = torch.arange(n)[None]
        rows.append({"tokens": tokens, "labels": torch.randint(1, VOCAB, (1, n), generator=gen),
                     "loss_mask": (positions % 7 != 3).float(), "position_ids": positions})
    documents = step_documents(rows, EOD, dynamic_document_multiple(setup.cp_size))
    for doc in documents:  # positions count on through the padding: each token's position is its row
        doc["position_ids"] = torch.arange(doc["tokens"].numel())
    return documents


def dynamic_model(setup: Setup, budget: int, world_group: Any, alone: Any):
    """The recipe's GPT (first ``LAYERS`` layers, fp32, ``VOCAB`` tokens) under dynamic CP over ``world_group``;
    ``alone``: this rank's one-rank group (tensor, pipeline and fixed context parallel groups)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from ..recipes.schema import decoder_spec, gpt_model_kwargs
    from .layer import fp32_config

    recipe = setup.model
    skip = recipe.window_attn_skip_freq
    recipe = dataclasses.replace(recipe, num_layers=min(LAYERS, recipe.num_layers),
                                 seq_length=setup.cp_size * budget,  # the longest document
                                 window_attn_skip_freq=skip[:LAYERS] if isinstance(skip, list) else skip,
                                 context_parallel_size=1, hybrid_context_parallel=True,
                                 max_seqlen_per_dp_cp_rank=budget)
    m, config = fp32_config(recipe, setup, calculate_per_token_loss=True)
    groups = ProcessGroupCollection(tp=alone, pp=alone, mp=alone, embd=alone, pos_embd=alone, cp=alone, tp_cp=alone,
                                    dp=world_group, dp_cp=world_group, tp_dp_cp=world_group)
    with _SEEDED:  # the same weights on every rank, also where the ranks are threads of one process
        torch.manual_seed(setup.seed)
        return GPTModel(config, decoder_spec(m, config), pg_collection=groups, **gpt_model_kwargs(m, VOCAB))


def with_loss(model) -> Callable[..., torch.Tensor]:
    """``model`` called as ``run_plan`` calls it, the per-token loss ``[b, s]`` from its logits by torch's cross
    entropy (megatron-core's own reads ``parallel_state``'s tensor parallel group, which this check does not make)."""
    def per_token_loss(tokens, position_ids, attention_mask, labels, packed_seq_params=None) -> torch.Tensor:
        logits = model(tokens, position_ids, attention_mask, packed_seq_params=packed_seq_params)
        return torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")
    return per_token_loss


@dataclass
class RankStep:
    """What one rank's step left: ``(document, positions, per-token losses, group size)`` per document it ran;
    on rank 0 also the CP = 1 run's per-token losses by document and the figures of the summed gradients."""

    left: list[tuple[int, list[int], list[float], int]]
    reference: Optional[dict[int, torch.Tensor]] = None
    gradients: Optional[dict[str, tuple[float, float]]] = None


def step_on_rank(setup: Setup, world_group: Any, alone: Any, fault: Optional[str] = None) -> RankStep:
    """This rank's part (collective over ``world_group``): the start-up groups, the model, the planned and agreed
    step and the gradients' all-reduce; then on rank 0 the CP = 1 run (every document alone), which
    communicates nothing, so that a failure there leaves no rank waiting in a collective."""
    from ..megatron.dynamic_groups import build_sub_groups
    from ..pretrain.dynamic import agreed_plan, run_plan

    world, me = dist.get_world_size(world_group), dist.get_rank(world_group)
    sizes = group_sizes(setup)
    budget = step_budget(setup.dynamic_budget, setup.seq_len, world)
    device = torch.device(setup.device)
    groups = build_sub_groups(world_group, sizes)
    model = dynamic_model(setup, budget, world_group, alone).to(device)
    documents = [{key: x.to(device) for key, x in doc.items()}
                 for doc in step_documents_of(setup, step_lengths(budget, sizes))]
    plan = agreed_plan([int(doc["tokens"].numel()) for doc in documents], budget, planned_sizes(sizes, me, fault),
                       world_group)
    _, _, ran = run_plan(with_loss(model), documents, plan, groups, world_group)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=world_group)
    left = [(x.doc, x.positions.tolist(), x.per_token.tolist(), x.group_size) for x in ran]
    if me != 0:
        return RankStep(left)
    summed = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    alone_plan = [[list(range(len(documents)))] + [[] for _ in range(world - 1)]]
    _, _, alone = run_plan(with_loss(model), documents, alone_plan, groups, world_group)
    gradients = {name: error_and_bound(summed[name].cpu(), p.grad.cpu()) for name, p in model.named_parameters()}
    return RankStep(left, {x.doc: x.per_token for x in alone}, gradients)


def simulated_step(setup: Setup, fault: Optional[str] = None) -> list[RankStep]:
    """``step_on_rank`` on every rank of the setup's world as threads of this process (CPU, ``inprocess``)."""
    import megatron_patches

    from .inprocess import SimGroup, run_ranks

    megatron_patches.apply_all(device=torch.device("cpu"))
    cpu = dataclasses.replace(setup, device="cpu")
    return run_ranks(setup.cp_size, lambda rank: step_on_rank(cpu, SimGroup(range(setup.cp_size)), SimGroup([rank]),
                                                              fault), initialized=True)


def verdict(setup: Setup, rank0: RankStep, lefts: list[list]) -> CheckResult:
    """Every rank's per-token losses (``lefts[r]``: rank r's ``RankStep.left``) and rank 0's gradient figures
    against the CP = 1 run (on rank 0); a failure names the group sizes whose losses are off."""
    reference, gradients = rank0.reference, rank0.gradients
    covered = {doc: torch.zeros(len(losses), dtype=torch.bool) for doc, losses in reference.items()}
    sizes_ran, loss_errors = {}, {}  # document -> its group size; group size -> worst per-token loss error
    for doc, positions, losses, n in (entry for left in lefts for entry in left):
        sizes_ran[doc] = n
        covered[doc][positions] = True
        error = float((torch.tensor(losses).double() - reference[doc][positions].double()).abs().max())
        loss_errors[n] = max(loss_errors.get(n, 0.0), error)
    loss = (max(loss_errors.values()), LAYER_TOL * max(1.0, max(float(x.abs().max()) for x in reference.values())))
    worst = max(gradients, key=lambda n: gradients[n][0] / gradients[n][1])
    bad = []
    off = [n for n, error in sorted(loss_errors.items()) if not error <= loss[1]]
    if off:
        bad.append(f"per-token loss error {loss[0]:.2e} > bound {loss[1]:.2e} on groups of {off} ranks")
    off = [name for name, (error, bound) in gradients.items() if not error <= bound]
    if off:
        bad.append(f"{len(off)} of {len(gradients)} parameter gradients off, worst {worst} {gradients[worst][0]:.2e} "
                   f"> bound {gradients[worst][1]:.2e}")
    bad += [f"document {doc}: tokens no rank computed" for doc, seen in covered.items() if not seen.all()]
    expected = group_sizes(setup)
    if sorted(set(sizes_ran.values())) != expected:
        bad.append(f"documents ran on groups of {sorted(set(sizes_ran.values()))} ranks, not {expected}")
    lengths = [len(reference[doc]) for doc in sorted(reference)]
    summary = (f"{len(lengths)} documents ({min(lengths)}..{max(lengths)} tokens) on groups of "
               f"{', '.join(str(n) for n in expected)} of {setup.cp_size} ranks: per-token loss {loss[0]:.1e} <= "
               f"{loss[1]:.1e}; {len(gradients)} parameter gradients, worst {worst} {gradients[worst][0]:.1e} <= "
               f"{gradients[worst][1]:.1e} (fp32, against each document alone)")
    figures = {"loss": loss, **gradients}
    return CheckResult(NAME, not bad, "; ".join(bad) or summary,
                       {"group_size": sizes_ran, "lengths": lengths,
                        **{n: {"error": e, "bound": b} for n, (e, b) in figures.items()}})
