"""Opt-in timeline of the ring: when each step's blocks computed and how long each receive blocked.

``with record_timeline() as tl: ...`` makes the executor and the ring rotation append
``Event(kind, step, t0, t1)`` (``time.perf_counter`` seconds) to ``tl.events``: ``forward_compute`` /
``backward_compute`` for a step's block tasks, ``kv_wait`` / ``dkv_wait`` for the time a step spent
blocked on the transfer that was posted before the previous compute. A short wait next to a long
transfer is the overlap. Outside the context the hooks cost one ``is None`` check each; nothing is
kept. Used by ``tools/bench_attention.py``; not thread-safe (one recording per process at a time).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional


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
