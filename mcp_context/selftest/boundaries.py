"""The model's boundaries: what Megatron's batch slicing and loss do at the CP shard edges.

A batch of tokens, labels, loss mask and position ids over the full sequence is sliced for every CP
rank with ``slice_batch_for_cp`` (the model's own slicing: zigzag, per document when packed, as
megatron-core's ``get_batch_on_this_cp_rank`` and TE's thd partitioning), then:

- ``unslice``: the shards put back with ``unshard_sequence`` give every tensor back exactly;
- ``positions``: the gathered position ids restart at 0 at every document start and count up by one
  inside a document (packed), or are 0..S-1 (unpacked) — RoPE offsets right for every layout;
- ``layout``: every rank's slice against a definition that is not the code under test
  (``layout_truth``: megatron-core's ``get_batch_on_this_cp_rank`` and RoPE slicing, and each
  layout's positions written out from its definition), for the batch's zigzag and the engine's layout;
- ``loss``: the masked per-token loss averaged over the CP ranks (``masked_token_mean``) equals the
  full sequence's masked mean on every rank, and the ranks' backward shares add up to it.

Distributed, each rank slices with its real CP group and the loss all-reduces; ``--simulate`` plays
each rank in turn in a fake one-process world, and the loss runs on every member as threads of this
process whose all-reduce is carried between them (``inprocess``).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from ..layouts import shard_index, unshard_sequence
from .setup import Setup

KEYS = ("tokens", "labels", "loss_mask", "position_ids")
LOSS_TOL = 1e-12
"""fp64 masked means of O(1) losses over <= 1M tokens: summation order only (~1e-15 relative)."""


def full_batch(setup: Setup, packed: bool) -> tuple[dict, Optional[object]]:
    """Seeded ``[b, S]`` tokens, labels (tokens shifted by one), loss mask (random zeros; padding rows 0)
    and position ids (restarting per document, counting on through a document's padding) and the
    per-token loss (fp64); with ``packed`` also megatron-core's ``PackedSeqParams`` (thd)."""
    gen = torch.Generator().manual_seed(setup.seed + 7)
    batch_size = 1 if packed else setup.batch
    seq = setup.seq_len
    tokens = torch.randint(0, 32000, (batch_size, seq + 1), generator=gen)
    mask = (torch.rand(batch_size, seq, generator=gen) > 0.1).to(torch.float32)
    positions = torch.arange(seq).expand(batch_size, seq).clone()
    params = None
    if packed:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu, padded = setup.documents
        for d in range(len(cu) - 1):
            positions[0, padded[d]:padded[d + 1]] = torch.arange(padded[d + 1] - padded[d])
            mask[0, padded[d] + cu[d + 1] - cu[d]:padded[d + 1]] = 0.0
        cu_t, padded_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)
        longest = int(padded_t.diff().max())
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, cu_seqlens_q_padded=padded_t,
                                 cu_seqlens_kv_padded=padded_t, max_seqlen_q=longest, max_seqlen_kv=longest)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask, "position_ids": positions,
             "per_token_loss": torch.rand(batch_size, seq, generator=gen, dtype=torch.float64) * 10}
    return batch, params


@contextlib.contextmanager
def _fake_rank(cp_size: int, rank: int):
    from ..plan.dryrun import fake_world

    with fake_world(cp_size, rank):
        yield dist.group.WORLD


def slices_per_rank(setup: Setup, batch: dict, params, group=None) -> list[dict]:
    """Every CP rank's ``slice_batch_for_cp`` of ``batch`` (with ``group``: this rank's, all-gathered;
    without: each rank played in a fake world)."""
    from ..megatron.batch import slice_batch_for_cp

    if group is not None:
        mine = slice_batch_for_cp(batch, group, params)
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        return every
    slices = []
    for rank in range(setup.cp_size):
        with _fake_rank(setup.cp_size, rank) as world:
            slices.append(slice_batch_for_cp(batch, world, params))
    return slices


def unsliced(slices: list[dict], params) -> dict:
    cu = None if params is None else params.cu_seqlens_q
    padded = None if params is None else params.cu_seqlens_q_padded
    return {key: unshard_sequence([s[key] for s in slices], "zigzag", 1, cu, padded) for key in
            (*KEYS, "per_token_loss")}


def check_unslice(batch: dict, back: dict) -> list[str]:
    """What did not come back exactly."""
    return [f"{key}: {int((back[key] != batch[key]).sum())} of {batch[key].numel()} values differ"
            for key in KEYS if not torch.equal(back[key], batch[key])]


def check_positions(setup: Setup, back: dict, packed: bool) -> list[str]:
    """Positions restart at every document start and count up by one inside it (0..S-1 unpacked)."""
    pos = back["position_ids"][0]
    if not packed:
        return [] if torch.equal(pos, torch.arange(setup.seq_len)) else ["positions are not 0..S-1 after un-slicing"]
    cu, padded = setup.documents
    problems = []
    for d in range(len(cu) - 1):
        doc = pos[padded[d]:padded[d] + cu[d + 1] - cu[d]]
        if not torch.equal(doc, torch.arange(doc.numel())):
            problems.append(f"document {d} (rows {padded[d]}..): positions start at {int(doc[0])}, not a 0.. run")
    return problems


def check_layout(setup: Setup, batch: dict, slices: list[dict], packed: bool) -> list[str]:
    """Every rank's slice (``slice_batch_for_cp``: zigzag, per document when packed) against megatron-core's
    slicing and RoPE positions and the zigzag's definition, and the engine's layout (``setup.layout``)
    against its definition; what differs, rank by rank."""
    from .layout_truth import (balanced_problems, expected_positions, expected_rows, megatron_batch,
                               megatron_rope_positions)

    cp, seq = setup.cp_size, setup.seq_len
    cu, padded = (list(setup.documents[0]), list(setup.documents[1])) if packed else (None, None)
    problems = []
    for rank, mine in enumerate(slices):
        rows = expected_rows("zigzag", cp, rank, seq, padded)
        not_zigzag = [key for key in ("tokens", "labels", "loss_mask") if not torch.equal(mine[key], batch[key][:, rows])]
        positions = mine["position_ids"][0].tolist()
        not_zigzag += ["position_ids"] if positions != expected_positions(rows, padded) else []
        if not_zigzag:
            problems.append(f"rank {rank}: {', '.join(not_zigzag)} are not zigzag chunks {rank} and "
                            f"{2 * cp - 1 - rank}{' of every document' if packed else ''}")
        not_megatron = [] if packed else [key for key, theirs in megatron_batch(
            {key: batch[key] for key in KEYS}, cp, rank).items() if not torch.equal(mine[key], theirs)]
        not_megatron += ["RoPE positions"] if positions != megatron_rope_positions(
            seq, cp, rank, torch.device(setup.device), padded) else []
        if not_megatron:
            problems.append(f"rank {rank}: {', '.join(not_megatron)} differ from megatron-core's slice for CP rank "
                            f"{rank} (" + ("_get_thd_freqs_on_this_cp_rank per document" if packed else
                                           "get_batch_on_this_cp_rank, get_pos_emb_on_this_cp_rank") + ")")
    engine = [shard_index(seq, cp, r, setup.layout, cu, padded).tolist() for r in range(cp)]
    if setup.layout == "balanced":
        problems += [f"layout balanced: {p}" for p in balanced_problems(engine, seq)]
    else:
        problems += [f"rank {r}: layout {setup.layout} gives it rows {rows[:3]}..., not {want[:3]}... (the layout's "
                     f"definition)" for r, rows in enumerate(engine)
                     if rows != (want := expected_rows(setup.layout, cp, r, seq, padded))]
    return problems


def check_loss(shares: list[tuple[float, float]], batch: dict) -> tuple[list[str], dict]:
    """Every rank's ``(loss_for_backward, global_mean)`` against the full sequence's masked mean."""
    loss, mask = batch["per_token_loss"], batch["loss_mask"].double()
    full = float((loss * mask).sum() / mask.sum().clamp(min=1))
    total = sum(share for share, _ in shares)
    worst = max(abs(g - full) for _, g in shares)
    problems = []
    if worst > LOSS_TOL * max(1.0, abs(full)):
        problems.append(f"the CP-averaged loss differs from the full-sequence loss by {worst:.2e}")
    if abs(total - full) > LOSS_TOL * max(1.0, abs(full)):
        problems.append(f"the ranks' backward shares add to {total:.12g}, not the full loss {full:.12g}")
    return problems, {"full_loss": full, "cp_loss": shares[0][1], "error": max(worst, abs(total - full))}


def distributed_shares(mine: dict, group, device: torch.device) -> list[tuple[float, float]]:
    """``masked_token_mean`` over the real CP group on this rank's slice (on ``device``: NCCL reduces
    only CUDA tensors); every rank's result."""
    from ..megatron.batch import masked_token_mean

    share, global_mean = masked_token_mean(mine["per_token_loss"].to(device), mine["loss_mask"].to(device), group)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (float(share), float(global_mean)), group=group)
    return every


def simulated_shares(slices: list[dict]) -> list[tuple[float, float]]:
    """Every member's ``masked_token_mean`` over a CP group of this process's threads (``inprocess``: its
    all-reduce carried between them), as ``distributed_shares``."""
    from ..megatron.batch import masked_token_mean
    from .inprocess import SimGroup, run_ranks

    group = SimGroup(range(len(slices)))

    def member(rank: int) -> tuple[float, float]:
        share, global_mean = masked_token_mean(slices[rank]["per_token_loss"], slices[rank]["loss_mask"], group)
        return float(share), float(global_mean)
    return run_ranks(len(slices), member)
