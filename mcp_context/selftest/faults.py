"""Faults the self-test can plant in itself (``--plant``), for its own tests only.

A self-test that never fails proves nothing: each fault here is a silent CP bug seen in the field, and
``tests/test_selftest.py`` plants each one and checks that the run exits non-zero naming the check
that caught it. Never use ``--plant`` to check a cluster: a planted run is wrong on purpose.
"""
from __future__ import annotations

from typing import Optional

FAULTY_RANK = 1
"""The CP rank a fault is planted on (CP sizes are at least 2)."""

FAULTS = {
    "layout-mismatch": "the data is sliced in another layout than the engine is told",
    "wrong-scale": f"CP rank {FAULTY_RANK} uses a softmax scale 5 % too large",
    "dropped-sink": f"CP rank {FAULTY_RANK} passes no softmax_offset (attention sinks)",
    "cu-seqlens-differ": f"CP rank {FAULTY_RANK} reads a packing with one document boundary moved",
    "dynamic-group-moved": f"rank {FAULTY_RANK} plans dynamic CP without one-rank groups: a short document lands "
                           f"in a group of several ranks there",
}

WRONG_SCALE = 1.05


def check_fault(fault: Optional[str], sink: bool, packed: bool, dynamic: bool) -> None:
    """A fault must have something to act on: a sink to drop, documents to move, a dynamic-CP plan."""
    if fault is None:
        return
    if fault not in FAULTS:
        raise ValueError(f"--plant {fault!r} is not a fault; choose one of {', '.join(FAULTS)}")
    if fault == "dropped-sink" and not sink:
        raise ValueError("--plant dropped-sink needs sinks: add --softmax-type learnable")
    if fault == "cu-seqlens-differ" and not packed:
        raise ValueError("--plant cu-seqlens-differ needs packed documents: add --packed")
    if fault == "dynamic-group-moved" and not dynamic:
        raise ValueError("--plant dynamic-group-moved needs dynamic CP: use a recipe with "
                         "model.hybrid_context_parallel=true, e.g. --recipe recipes/tiny_dynamic_cp_cpu.yaml")


def sliced_layout(layout: str, packed: bool, fault: Optional[str]) -> str:
    """The layout the data is actually sliced in: ``layout``, or another one under 'layout-mismatch'."""
    if fault != "layout-mismatch":
        return layout
    if packed:
        return "balanced" if layout == "zigzag" else "zigzag"
    return "contiguous" if layout != "contiguous" else "zigzag"


def scale_on_rank(scale: float, cp_rank: int, fault: Optional[str]) -> float:
    return scale * WRONG_SCALE if fault == "wrong-scale" and cp_rank == FAULTY_RANK else scale


def sink_on_rank(sink, cp_rank: int, fault: Optional[str]):
    return None if fault == "dropped-sink" and cp_rank == FAULTY_RANK else sink
