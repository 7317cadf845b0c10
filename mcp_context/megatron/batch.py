"""Context-parallel batches and losses: slice a batch to this CP rank; average the loss over all ranks.

Slicing is the zigzag layout, identical to megatron-core's ``get_batch_on_this_cp_rank`` and to its
RoPE slicing (``get_pos_emb_on_this_cp_rank``), so tokens, labels, loss mask, position ids and rotary
embeddings stay aligned. A packed batch (``packed_seq_params``, thd, b = 1) is sliced per document
(each document's chunks r and 2cp-1-r, as TE's ``thd_get_partitioned_indices`` and megatron-core's thd
RoPE), and its position ids restart at 0 in every document. The loss is averaged over the *global* number of valid tokens across the CP
(and DP) ranks — averaging per rank first would weight ranks with few valid tokens too much.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..layouts import shard_positions, shard_sequence

SEQ_DIM = {"attention_mask": 2}  # [b, 1, s, s]: queries along dim 2; everything else is [b, s]


def slice_batch_for_cp(batch: dict, cp_group: Optional[ProcessGroup] = None, packed_seq_params: Any = None
                       ) -> dict:
    """This CP rank's part of every ``[b, s]`` tensor in ``batch`` (``attention_mask`` along its query
    dim); ``None`` values pass through. ``cp_group`` defaults to megatron-core's CP group.

    With ``packed_seq_params`` (thd: ``cu_seqlens_q`` and optional ``cu_seqlens_q_padded``, global) the
    ``[1, s]`` tensors are sliced per document and ``position_ids`` become the positions within each
    document (RoPE restarts per document); a packed batch has no ``attention_mask``."""
    if cp_group is None:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    if packed_seq_params is None:
        if cp_size == 1:
            return dict(batch)
        return {key: None if val is None else shard_sequence(val, cp_size, cp_rank, "zigzag", dim=SEQ_DIM.get(key, 1))
                for key, val in batch.items()}
    if batch.get("attention_mask") is not None:
        raise ValueError("a packed batch (packed_seq_params) takes its mask from cu_seqlens; set attention_mask "
                         "to None")
    cu, padded = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded
    out = {}
    for key, val in batch.items():
        if val is None:
            out[key] = None
        elif val.dim() != 2 or val.shape[0] != 1:
            raise ValueError(f"batch[{key!r}] has shape {tuple(val.shape)}; a packed batch is [1, s] (b = 1): pack "
                             f"the documents into one sequence")
        elif key == "position_ids":
            out[key] = shard_positions(val.shape[1], cp_size, cp_rank, "zigzag", cu, padded).to(val.device)[None]
        else:
            out[key] = shard_sequence(val, cp_size, cp_rank, "zigzag", 1, cu, padded)
    return out


def masked_token_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, group: Optional[ProcessGroup]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean loss over the valid tokens of all ranks in ``group`` (CP, or CP x DP).

    Returns ``(loss_for_backward, global_mean)``: ``loss_for_backward`` is this rank's masked sum
    divided by the global token count, so *summing* gradients over ``group`` gives the gradient of
    the global mean (megatron-core DDP does this with ``calculate_per_token_loss=True``).
    ``global_mean`` (no grad) is the same number on every rank, for logging. No valid token anywhere
    gives 0, not NaN.
    """
    mask = loss_mask.to(per_token_loss.dtype)
    local_sum = (per_token_loss * mask).sum()
    totals = torch.stack([local_sum.detach(), mask.sum()])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    count = totals[1].clamp(min=1)
    return local_sum / count, totals[0] / count
