"""One trace channel for what the engine does: bytes it sends (by operation and peer), and, while a
timeline records, when each ring step computed and how long each wait blocked.

- ``comm_stats`` (always on, a few counters): every communication primitive records what leaves
  this rank — by operation (``ring_kv``, ``ring_dkv``, ``all_to_all``, ``all_gather``,
  ``reduce_scatter``), by destination (global rank) and as a count of calls. Data a rank keeps for
  itself is not counted. Tests check the counts against each scheme's analytic figure, the planner
  reads bytes and destinations from a dry run, the benchmark reports them. ``comm_stats.reset()``
  between runs.
- ``record_timeline()`` (opt in): the executor and the ring rotation append ``Event(kind, step, t0,
  t1)`` (``time.perf_counter`` seconds): ``forward_compute`` / ``backward_compute`` for a step's block
  tasks, ``kv_wait`` / ``dkv_wait`` for the time a step blocked on a transfer posted before the
  previous compute (in the backward a step's ``dkv_wait`` falls inside its compute, at its first
  dK/dV add: the partial sum travels with the step's K/V message). Outside the context the hooks cost one ``is None`` check each. Not thread-safe
  (one recording per process at a time).

Dependency-free: the comm layer, the algorithms, the planner and the benchmark all sit above it.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional


class CommStats:
    """Bytes this process sends, by operation and by destination, and how many sends of each."""

    def __init__(self) -> None:
        self.bytes_sent: Counter[str] = Counter()
        self.bytes_to: defaultdict[str, Counter[int]] = defaultdict(Counter)
        self.calls: Counter[str] = Counter()

    def record(self, op: str, bytes_to: Mapping[int, int]) -> None:
        """One call of ``op`` that sends ``bytes_to[peer]`` bytes to each global rank ``peer``."""
        for peer, nbytes in bytes_to.items():
            self.bytes_to[op][peer] += int(nbytes)
        self.bytes_sent[op] += int(sum(bytes_to.values()))
        self.calls[op] += 1

    @property
    def total(self) -> int:
        return sum(self.bytes_sent.values())

    def snapshot(self) -> tuple[dict[str, int], dict[str, dict[int, int]], dict[str, int]]:
        """Copies of ``(bytes_sent, bytes_to, calls)``: subtract two to get what happened between them."""
        return dict(self.bytes_sent), {op: dict(c) for op, c in self.bytes_to.items()}, dict(self.calls)

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.bytes_to.clear()
        self.calls.clear()


comm_stats = CommStats()


@dataclass(frozen=True)
class Event:
    kind: str
    step: int
    t0: float
    t1: float


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)


_current: Optional[Timeline] = None


def now() -> Optional[float]:
    """The time to start an event at, or None when no timeline is recording."""
    return None if _current is None else time.perf_counter()


def record(kind: str, step: int, t0: Optional[float]) -> None:
    """End the event started at ``t0`` (from ``now()``); does nothing when not recording."""
    if t0 is not None and _current is not None:
        _current.events.append(Event(kind, step, t0, time.perf_counter()))


@contextlib.contextmanager
def record_timeline() -> Iterator[Timeline]:
    global _current
    if _current is not None:
        raise RuntimeError("a timeline is already recording in this process; nest no recordings")
    _current = Timeline()
    try:
        yield _current
    finally:
        _current = None
