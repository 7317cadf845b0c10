"""Document packing for ``data.reset_attention_mask=true``: each micro-batch trained as packed documents.

Megatron's ``reset_attention_mask`` stops attention at document boundaries. Here the boundaries come
from the end-of-document tokens (megatron-core ``GPTDataset`` semantics: a document ends with its EOD
token, the next starts after it), and the samples of a micro-batch are concatenated into one packed
sequence (b = 1, ``qkv_format="thd"``): ``cu_seqlens`` holds the documents of every sample in order,
and each document is padded to a multiple of ``2 * context_parallel_size`` (``cu_seqlens_padded``),
what megatron-core's per-document zigzag slicing needs (times TP under sequence parallelism). Padding rows have token, label and position
0 and loss mask 0; the document mask keeps them out of every attention.

The dataset's own ``loss_mask`` (``eod_mask_loss``) and ``position_ids`` (``reset_position_ids``) are
kept, so both mean what they mean in Megatron; RoPE restarts per document through the thd packing
(megatron-core's thd RoPE), which under the document mask gives the same scores as global positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcp_context.data.documents import document_offsets

POSITIONS = "dataset_position_ids"
"""The packed batch's key for the dataset's position ids (``slice_batch_for_cp`` would replace a
``position_ids`` entry with positions restarting per document, whatever ``reset_position_ids`` says)."""


@dataclass(frozen=True)
class DocumentPacking:
    """How a micro-batch is packed: the end-of-document token and the multiple every document is padded to."""

    eod: int
    multiple: int

    def __call__(self, micro_batch: dict) -> dict:
        """The micro-batch's samples as one packed ``[1, S]`` sequence (``tokens``, ``labels``,
        ``loss_mask`` and the dataset's position ids under ``POSITIONS``) with global int32
        ``cu_seqlens`` and ``cu_seqlens_padded``: the documents of sample 0, then of sample 1, ..."""
        if micro_batch.get("attention_mask") is not None:
            raise ValueError("data.reset_attention_mask=true takes the document mask from the end-of-document "
                             "tokens; set data.create_attention_mask=false")
        sources = {"tokens": "tokens", "labels": "labels", "loss_mask": "loss_mask", POSITIONS: "position_ids"}
        offsets = [document_offsets(row, self.eod, self.multiple) for row in micro_batch["tokens"]]
        total = sum(sample_padded[-1] for _, sample_padded in offsets)
        out = {key: micro_batch[src].new_zeros(1, total) for key, src in sources.items()}
        cu, padded = [0], [0]
        for b, (sample_cu, sample_padded) in enumerate(offsets):
            shift = torch.tensor(sample_padded[:-1]) - torch.tensor(sample_cu[:-1])  # per document
            rows = padded[-1] + torch.arange(sample_cu[-1]) + torch.repeat_interleave(
                shift, torch.tensor(sample_cu).diff())
            for key, src in sources.items():
                out[key][0, rows] = micro_batch[src][b]
            cu += [cu[-1] + c for c in sample_cu[1:]]
            padded += [padded[-1] + p for p in sample_padded[1:]]
        out["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
        out["cu_seqlens_padded"] = torch.tensor(padded, dtype=torch.int32)
        return out


def packed_seq_params(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_group: Any) -> Any:
    """megatron-core's ``PackedSeqParams`` (thd) of one packed sequence, for ``slice_batch_for_cp`` and
    ``GPTModel.forward``; ``max_seqlen`` is the longest padded document (the RoPE table's length)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int(cu_seqlens_padded.diff().max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
                           max_seqlen_q=longest, max_seqlen_kv=longest, cp_group=cp_group)
