"""The engine of every CP rank in one process: the exchange itself, as the distributed run does it.

Each CP rank's ``EngineRun`` (its shards, ``ContextParallelAttention`` as a model layer calls it,
forward and backward) runs on a thread of ``inprocess.run_ranks``: the layout, the all-to-all and its
reordering, the gather or the ring and the merge are the package's own code, the transfers are
matched before they move. In fp64 on the CPU at a short sequence (``EXCHANGE_CHUNKS`` rows per chunk
of the layout, the setup's heads and head dims), so the check is cheap at any model size; the order of
rows and heads does not depend on the length.

Both modes run it: ``--simulate`` to check what it cannot check otherwise, the distributed run before
its first engine call, so that transfers that do not match are a named failure, not a transport error.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ..comm import HCPGroups
from ..comm.groups import level_members
from .distributed import EngineRun, in_order
from .inprocess import SimGroup, run_ranks
from .setup import AttentionKind, Setup, with_documents

EXCHANGE_CHUNKS = 8
"""Rows per chunk of the layout (a chunk: S / 2P for zigzag and packed, S / P otherwise)."""


def short_setup(setup: Setup) -> Setup:
    """``setup`` at the exchange check's length, fp64 on the CPU (the packing drawn again for it)."""
    packed = any(k.packed for k in setup.kinds)
    multiple = 2 * setup.cp_size if setup.layout == "zigzag" or packed else setup.cp_size
    seq_len = min(setup.seq_len, EXCHANGE_CHUNKS * multiple)
    return with_documents(replace(setup, seq_len=seq_len, dtypes=(torch.float64,), device="cpu", documents=((), ())))


def engine_in_process(setup: Setup, kind: AttentionKind, data: dict, fault: Optional[str] = None,
                      log: Optional[list] = None) -> dict:
    """Every CP rank's forward and backward of ``kind`` on ``data`` (fp64), each on its own thread, in
    full-sequence order (``in_order``); ``log``: every collective call and send, as ``run_ranks``."""
    cp_group = SimGroup(range(setup.cp_size))

    def play(rank: int) -> dict:
        inner = SimGroup(level_members(list(setup.sizes), 0, rank)) if len(setup.sizes) > 1 else cp_group
        return EngineRun(setup, kind, torch.float64, data, HCPGroups(cp_group, inner, setup.sizes), fault).call()

    return in_order(run_ranks(setup.cp_size, play, log), setup, kind)
