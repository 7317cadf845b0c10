"""Where the documents of a dataset sample begin and end: megatron-core ``GPTDataset`` semantics (a document
ends with its end-of-document token; the next starts after it; a sample cuts documents at its edges).

The pretrain loop packs and plans by these offsets (``pretrain.packing``, ``pretrain.dynamic``) and the
planner's balance report reads a step's document lengths with them, so both see the same documents.
"""
from __future__ import annotations

import torch


def document_offsets(tokens: torch.Tensor, eod: int, multiple: int) -> tuple[list[int], list[int]]:
    """``(cu_seqlens, cu_seqlens_padded)`` of one ``[s]`` token row: a document ends at each ``eod``
    token (inclusive) and at the row's end; each padded length is the next multiple of ``multiple``."""
    ends = (torch.nonzero(tokens == eod).flatten() + 1).tolist()
    if not ends or ends[-1] != tokens.numel():
        ends.append(tokens.numel())
    cu, padded = [0], [0]
    for end in ends:
        length = end - cu[-1]
        cu.append(end)
        padded.append(padded[-1] + length + (-length % multiple))
    return cu, padded
