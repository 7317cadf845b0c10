"""Which context-parallel layouts are possible for a model, a sequence and a GPU count.

A ``Candidate`` is one choice of ``context_parallel_size``, ``hierarchical_context_parallel_sizes``,
``cp_comm_type`` and token layout. ``enumerate_candidates`` lists every one the engine accepts: CP
sizes dividing the GPUs left after TP and PP, every flat scheme, every ordered factorisation into
two or more levels for the hierarchical ones (``cp_rules.COMM_SCHEMES``), every layout the sequence length can be split by. A choice the
engine would refuse (heads not divisible by the all-to-all degree, ...) is returned separately with
the engine's own error message, so the table can say why it is absent.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cp_rules import COMM_SCHEMES, COMM_TYPES, LAYOUTS, a2a_degree, check_heads, check_seq_len
from ..cp_rules import heads_per_tp_rank  # noqa: F401 - the planner's callers take it from here

NO_CP = "none"  # the cp_comm_type column of a CP size of 1 (no communication)


@dataclass(frozen=True)
class Candidate:
    cp_size: int
    sizes: tuple[int, ...]
    """``hierarchical_context_parallel_sizes`` (``(cp_size,)`` for a flat scheme)."""
    comm: str
    """``cp_comm_type``; ``"none"`` for CP size 1."""
    layout: str

    @property
    def a2a_degree(self) -> int:
        return 1 if self.cp_size == 1 else a2a_degree(self.comm, self.sizes)

    @property
    def engine_comm(self) -> str:
        """The scheme the engine runs (a CP size of 1 is a ring of one)."""
        return COMM_TYPES[0] if self.cp_size == 1 else self.comm

    def label(self) -> str:
        levels = "x".join(map(str, self.sizes)) if len(self.sizes) > 1 else str(self.cp_size)
        return f"cp{levels} {self.comm} {self.layout}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorisations(n: int, min_levels: int = 2) -> list[tuple[int, ...]]:
    """Ordered factorisations of ``n`` into at least ``min_levels`` factors, each at least 2."""
    if n == 1:
        return [()] if min_levels <= 0 else []
    out = []
    for first in _divisors(n)[1:]:
        for rest in _factorisations(n // first, min_levels - 1):
            out.append((first,) + rest)
    return out


def enumerate_candidates(cp_sizes: list[int], seq_len: int, heads: int, kv_heads: int
                         ) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """Valid candidates and rejected ones (with the reason) for these CP sizes.

    ``heads`` and ``kv_heads`` are per tensor-parallel rank.
    """
    valid: list[Candidate] = []
    rejected: list[tuple[Candidate, str]] = []
    for cp in cp_sizes:
        if cp == 1:
            options = [((NO_CP, (1,)), "contiguous")]
        else:
            schemes = [(name, sizes) for name, rule in COMM_SCHEMES.items()
                       for sizes in ([(cp,)] if rule.min_levels == 1 else _factorisations(cp, rule.min_levels))]
            options = [(s, layout) for s in schemes for layout in LAYOUTS]
        for (comm, sizes), layout in options:
            cand = Candidate(cp, sizes, comm, layout)
            try:
                check_seq_len(seq_len, cp, layout)
                if cp > 1:
                    check_heads(heads, kv_heads, cand.a2a_degree, comm)
            except ValueError as err:
                rejected.append((cand, str(err)))
                continue
            valid.append(cand)
    return valid, rejected


def cp_sizes_for(gpus: int, tp: int, pp: int) -> list[int]:
    """CP sizes that divide the ranks of one pipeline stage's TP-replicas (the rest is data parallel)."""
    if gpus % (tp * pp):
        raise ValueError(f"gpus={gpus} is not divisible by tensor_model_parallel_size * "
                         f"pipeline_model_parallel_size = {tp} * {pp} = {tp * pp}; choose TP and PP that divide it")
    return _divisors(gpus // (tp * pp))
