"""Per-rank work of one training step under dynamic CP and under a fixed CP size: attention FLOPs, linear
FLOPs and CP bytes sent by every data x context parallel rank, with their max, mean and max/mean.

Dynamic CP places each document of the step (padded to the largest group's zigzag multiple, as
``pretrain.dynamic.step_documents`` pads it) on the group our plan gives it
(``megatron.dynamic_plan.plan_sub_samples``, the groups the step runner uses), as one causal sequence.
A fixed CP size runs each sample packed (its documents padded to ``cp_rules.document_multiple``, the
padding masked out) over the CP ranks of the data parallel replica whose contiguous slice of the global
batch holds it (``pretrain.batches``). A group's hierarchy and scheme are the runner's
(``cp_rules.dynamic_cp_levels``), so a fixed CP of ``n`` ranks is what a dynamic group of ``n`` runs.

Every figure of a group comes from the planner's dry run of the engine on each of its ranks
(``dryrun.dry_run_rank``): the bytes the comm layer counts and the visible pairs of the tasks the
executor runs, times the layers; FLOPs per pair are the cost model's (``cost.flops_per_pair``,
forward+backward by ``cost.FWD_BWD_FLOP_FACTOR``), linear FLOPs per token the model's
(``model.linear_flops_per_token``). Figures are for the whole model at TP = PP = 1: tensor and pipeline
parallelism divide every rank's figures alike, so max/mean does not change. Not counted: the gradient
all-reduce (the same under both) and megatron-core's reroute of sub-samples (our runner has every rank
read the whole batch instead). This module does not read data (``batch.py`` reads a step's documents)
or print (``report.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..cp_rules import a2a_degree, document_multiple, dynamic_cp_levels, dynamic_cp_size, dynamic_cp_sizes, \
    dynamic_document_multiple, normalize_comm
from ..masks import Mask, attention_mask, documents_mask
from ..megatron.dynamic_plan import plan_sub_samples
from ..recipes.schema import ModelConfig
from .cost import FWD_BWD_FLOP_FACTOR, flops_per_pair
from .dryrun import RankShape, RankTraffic, dry_run_rank
from .model import linear_flops_per_token, planning_shape

LAYOUT = "zigzag"  # what megatron-core's batch slicing cuts a sub-sample and a packed document into


@dataclass(frozen=True)
class BalanceRequest:
    """One step's documents and the two ways of running them."""

    samples: tuple[tuple[int, ...], ...]
    """Document lengths (tokens, unpadded) of each sample of the step's global batch, in order."""
    world: int
    """Data x context parallel ranks."""
    budget: int
    """Dynamic CP's tokens a rank (``max_seqlen_per_dp_cp_rank``)."""
    cp: int
    """The fixed context_parallel_size compared (data parallel size: ``world / cp``)."""
    model: ModelConfig
    comm: str = "p2p"
    level0: Optional[int] = None
    """Adjacent ranks of one all-to-all domain (``hierarchical_context_parallel_sizes[0]``); None: ``world``."""
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(tuple(s) for s in self.samples))
        object.__setattr__(self, "model", planning_shape(self.model))
        object.__setattr__(self, "comm", normalize_comm(self.comm))
        for name in ("world", "budget", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not self.samples or not all(self.samples):
            raise ValueError(f"samples={list(map(list, self.samples))} must hold at least one sample of at least one "
                             f"document (its lengths in tokens)")
        for s, lengths in enumerate(self.samples):
            for d, n in enumerate(lengths):
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ValueError(f"samples[{s}][{d}]={n!r} must be a positive number of tokens; leave out "
                                     f"empty documents")
        if self.world % self.cp:
            divisors = [d for d in range(1, self.world + 1) if self.world % d == 0]
            raise ValueError(f"cp={self.cp} does not divide the world of {self.world} data x context parallel ranks; "
                             f"choose one of {divisors}")
        if len(self.samples) % self.data_parallel_size:
            raise ValueError(f"the step's {len(self.samples)} samples do not split evenly over the "
                             f"{self.data_parallel_size} data parallel replicas of cp={self.cp} (world {self.world}); "
                             f"choose a cp whose replicas get the same number of samples, or a global batch that is a "
                             f"multiple of {self.data_parallel_size}")
        if self.level0 is not None and (isinstance(self.level0, bool) or not isinstance(self.level0, int)
                                        or self.level0 < 1 or self.world % self.level0):
            raise ValueError(f"level0={self.level0!r} must be a positive divisor of world={self.world}: the ranks of "
                             f"one all-to-all domain (hierarchical_context_parallel_sizes[0])")
        dynamic_cp_levels(self.cp, self.world, self.level0 or self.world, self.comm, name="cp")

    @property
    def data_parallel_size(self) -> int:
        """Data parallel replicas at the fixed CP size."""
        return self.world // self.cp

    @property
    def mask(self) -> Mask:
        """The attention inside a document: causal, with the model's window."""
        return attention_mask(True, self.model.window_size)


@dataclass(frozen=True)
class Spread:
    """Max and mean over the ranks of one figure; ``ratio`` is max/mean (None when every rank has 0)."""

    max: float
    mean: float

    @property
    def ratio(self) -> Optional[float]:
        return self.max / self.mean if self.mean else None


def spread(values: Sequence[float]) -> Spread:
    return Spread(max(values), sum(values) / len(values))


@dataclass(frozen=True)
class RankWork:
    """One scheme's figures per data x context parallel rank, forward+backward, all layers."""

    attention_flops: tuple[float, ...]
    linear_flops: Optional[tuple[int, ...]]
    """None for a model whose linear FLOPs are not modelled (MoE)."""
    bytes_sent: tuple[int, ...]
    tokens: tuple[int, ...]
    """Tokens each rank holds (padding included)."""
    group_sizes: tuple[int, ...]
    """The size of the group that ran each placement (dynamic: each document; fixed: each sample)."""

    def spreads(self) -> dict[str, Spread]:
        """``attention_flops``, ``linear_flops`` (when modelled), ``flops`` (their sum), ``bytes_sent``."""
        out = {"attention_flops": spread(self.attention_flops)}
        if self.linear_flops is not None:
            out["linear_flops"] = spread(self.linear_flops)
            out["flops"] = spread([a + b for a, b in zip(self.attention_flops, self.linear_flops)])
        out["bytes_sent"] = spread(self.bytes_sent)
        return out


@dataclass(frozen=True)
class Balance:
    request: BalanceRequest
    dynamic: RankWork
    fixed: RankWork


@dataclass(frozen=True)
class _Placement:
    """A sequence (a document, or a packed sample) on ``size`` adjacent ranks from ``first_rank``."""

    first_rank: int
    size: int
    mask: Mask
    seq_len: int


def dynamic_placements(req: BalanceRequest) -> list[_Placement]:
    """Each document, padded as the step runner pads it, on the group ``plan_sub_samples`` gives it."""
    multiple = dynamic_document_multiple(req.world)
    sizes = dynamic_cp_sizes(req.world, req.level0 or req.world)
    lengths = []
    for s, sample in enumerate(req.samples):
        for d, n in enumerate(sample):
            padded = n + (-n % multiple)
            dynamic_cp_size(padded, req.budget, sizes, what=f"document {d} of sample {s} (padded to a multiple of "
                                                            f"{multiple})")
            lengths.append(padded)
    queues = plan_sub_samples(lengths, req.budget, sizes, req.world)[0]
    members: dict[int, list[int]] = {}
    for rank, ids in enumerate(queues):
        for sid in ids:
            members.setdefault(sid, []).append(rank)
    return [_Placement(members[sid][0], len(members[sid]), req.mask, n) for sid, n in enumerate(lengths)]


def fixed_placements(req: BalanceRequest) -> list[_Placement]:
    """Each sample, its documents packed, over the CP ranks of the replica whose slice of the batch holds it."""
    multiple = document_multiple(LAYOUT, req.cp)
    per_replica = len(req.samples) // req.data_parallel_size
    out = []
    for i, sample in enumerate(req.samples):
        cu, padded = [0], [0]
        for n in sample:
            cu.append(cu[-1] + n)
            padded.append(padded[-1] + n + (-n % multiple))
        mask = documents_mask(cu, padded, within=req.mask)
        out.append(_Placement(i // per_replica * req.cp, req.cp, mask, padded[-1]))
    return out


def rank_work(req: BalanceRequest, placements: Sequence[_Placement]) -> RankWork:
    """Sum each placement's dry-run figures onto its ranks (a repeated group, sequence and rank runs once)."""
    m = req.model
    per_token = linear_flops_per_token(m)
    attention, sent, tokens = [0.0] * req.world, [0] * req.world, [0] * req.world
    runs: dict[tuple, RankTraffic] = {}
    for p in placements:
        sizes, comm = dynamic_cp_levels(p.size, req.world, req.level0 or req.world, req.comm)
        shape = RankShape(p.seq_len, 1, m.num_attention_heads, m.num_query_groups, m.kv_channels, req.dtype,
                          m.v_head_dim)
        per_pair = flops_per_pair(shape, a2a_degree(comm, sizes)) * FWD_BWD_FLOP_FACTOR * m.num_layers
        for cp_rank in range(p.size):
            key = (sizes, comm, p.mask, p.seq_len, cp_rank)
            if key not in runs:
                runs[key] = dry_run_rank(comm, sizes, LAYOUT, p.mask, shape, cp_rank)
            traffic, rank = runs[key], p.first_rank + cp_rank
            attention[rank] += per_pair * sum(task.useful_pairs for step in traffic.tasks for task in step)
            sent[rank] += (sum(traffic.forward.values()) + sum(traffic.backward.values())) * m.num_layers
            tokens[rank] += p.seq_len // p.size
    linear = None if per_token is None else tuple(per_token * t for t in tokens)
    return RankWork(tuple(attention), linear, tuple(sent), tuple(tokens), tuple(p.size for p in placements))


def work_balance(req: BalanceRequest) -> Balance:
    """The step's per-rank work under dynamic CP and under ``req.cp``."""
    return Balance(req, rank_work(req, dynamic_placements(req)), rank_work(req, fixed_placements(req)))
