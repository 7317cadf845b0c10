"""Bytes each communication primitive sends from this process, by operation.

Every primitive in ``comm`` records what leaves this rank (data a rank keeps for itself is not
counted), so tests can check the counts against each scheme's analytic figure and benchmarks can
report them. Read ``comm_stats.bytes_sent`` after a call; ``comm_stats.reset()`` between runs.
"""
from __future__ import annotations

from collections import Counter


class CommStats:
    def __init__(self) -> None:
        self.bytes_sent: Counter[str] = Counter()

    def record(self, op: str, nbytes: int) -> None:
        self.bytes_sent[op] += int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.bytes_sent.values())

    def reset(self) -> None:
        self.bytes_sent.clear()


comm_stats = CommStats()
