"""How one member holds its results: which blocks write each query row, and what each block's call
does with its rows, so the work around the attention calls is only what the rows need.

A row one block writes takes that block's output as it is (``OWN``: copied into the result, nothing
when the block's output *is* the result). A row ``n >= 2`` blocks meet is summed in the accumulator
dtype with no copy into or out of an fp32 buffer:

- the first block's rows are held where the call left them (``HOLD``);
- the second reads them with its own (``PAIR``): into the fp32 accumulator, or straight into the
  result when it is also the last (``PAIR_LAST``: two blocks, one rounding);
- every later block merges into the accumulator (``MERGE``), and the last reads the accumulator and
  writes the result (``LAST``: one rounding to the inputs' dtype).

So the fp32 accumulator spans only the rows three or more blocks meet (``accumulator``). A zigzag ring's
member keeps its step-0 output as the result and sums its later blocks over the half of its rows they
meet; an all-gather's query run that meets two calls is merged once, into the result.

``through=True`` (a forward with an attention sink, whose merge comes after every block's) sends every
row through an fp32 accumulator over all rows: the first block is copied in (``FIRST``), the others
merge there (``MERGE``), and one copy writes the result after the sink.

The same bookkeeping over key rows starts a dK/dV sum (``runs_written``, ``first_key_rows``; the executor's
side is ``rotation.KeySums``): a key row's first block writes it, later ones add.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..schedule import BlockTask

OWN, HOLD, PAIR, PAIR_LAST, MERGE, LAST, FIRST = "own", "hold", "pair", "pair_last", "merge", "last", "first"


@dataclass(frozen=True)
class Piece:
    """What one call does with rows ``rows`` of its query run: ``role``, and for ``PAIR``/``PAIR_LAST`` the
    ``(step, task)`` whose output holds these rows' first block."""

    rows: tuple[int, int]
    role: str
    held: Optional[tuple[int, int]] = None


def _role(k: int, n: int, through: bool) -> str:
    """The role of the ``k``-th of the ``n`` blocks that write a row."""
    if through:
        return FIRST if k == 0 else MERGE
    if n == 1:
        return OWN
    if k == 0:
        return HOLD
    if k == 1:
        return PAIR_LAST if n == 2 else PAIR
    return LAST if k == n - 1 else MERGE


@dataclass(frozen=True)
class ResultPlan:
    """Per step and task, the ``Piece`` s of its query run (``pieces[step][task]``, in row order).

    ``covered``: every row is written by some block (the result needs no fill). ``adopted``: the
    ``(step, task)`` of the first call when its query run is every row and some of it is that call's alone,
    so its output is the result itself; else None (a first call whose rows all go on to be summed is not
    kept past the sum's start: the result is made at its first write, and what the call held costs no
    memory meanwhile). ``accumulator``: the rows
    ``[a, b)`` the fp32 accumulator spans (None: no row meets three blocks, and not ``through``).
    ``releases[step][task]``: the held outputs (``(step, task)``) no call after this one reads; ``holders``:
    every held output's ``(step, task)``."""

    pieces: tuple[tuple[tuple[Piece, ...], ...], ...]
    rows: int
    covered: bool
    adopted: Optional[tuple[int, int]]
    accumulator: Optional[tuple[int, int]]
    through: bool
    releases: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    holders: frozenset[tuple[int, int]]

    @property
    def merges(self) -> bool:
        """Some row meets more than one block."""
        return any(p.role != OWN for step in self.pieces for task in step for p in task)

    @classmethod
    def build(cls, tasks: Sequence[Sequence[BlockTask]], rows: int, through: bool = False) -> "ResultPlan":
        order = [(s, i, t.q) for s, step in enumerate(tasks) for i, t in enumerate(step) if t.q[0] < t.q[1]]
        cuts = sorted({0, rows} | {r for *_, q in order for r in q})
        segments = [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]
        writers = {seg: [(s, i) for s, i, q in order if q[0] <= seg[0] and seg[1] <= q[1]] for seg in segments}
        pieces: list[list[list[Piece]]] = [[[] for _ in step] for step in tasks]
        for seg in segments:  # row order: each task's pieces come out sorted
            ws = writers[seg]
            for k, (s, i) in enumerate(ws):
                role = _role(k, len(ws), through)
                held = ws[0] if role in (PAIR, PAIR_LAST) else None
                mine = pieces[s][i]
                if mine and mine[-1].rows[1] == seg[0] and (mine[-1].role, mine[-1].held) == (role, held):
                    mine[-1] = Piece((mine[-1].rows[0], seg[1]), role, held)  # one call per contiguous run
                else:
                    mine.append(Piece(seg, role, held))
        last_reader: dict[tuple[int, int], tuple[int, int]] = {}
        for s, step in enumerate(pieces):
            for i, task in enumerate(step):
                for p in task:
                    if p.held is not None:
                        last_reader[p.held] = (s, i)
        releases: list[list[list[tuple[int, int]]]] = [[[] for _ in step] for step in tasks]
        for holder, (s, i) in sorted(last_reader.items()):
            releases[s][i].append(holder)
        summed = [seg for seg in segments if len(writers[seg]) >= (1 if through else 3)]
        accumulator = (0, rows) if through else (summed[0][0], summed[-1][1]) if summed else None
        adopted = order[0][:2] if order and order[0][2] == (0, rows) and any(
            p.role in (OWN, FIRST) for p in pieces[order[0][0]][order[0][1]]) else None
        return cls(tuple(tuple(tuple(task) for task in step) for step in pieces), rows,
                   all(writers[seg] for seg in segments), adopted, accumulator, through,
                   tuple(tuple(tuple(r) for r in step) for step in releases), frozenset(last_reader))


def most_blocks_per_key(tasks: Sequence[Sequence[BlockTask]]) -> int:
    """The most tasks of one step that read the same key row: how many block dK/dV a row's sum adds here."""
    most = 0
    for step in tasks:
        edges = sorted([(t.kv[0], 1) for t in step] + [(t.kv[1], -1) for t in step])
        depth = 0
        for _, d in edges:  # an end sorts before a start at the same row: touching ranges do not overlap
            depth += d
            most = max(most, depth)
    return most


def runs_written(rows: tuple[int, int], written: Sequence[tuple[int, int]]) -> list[tuple[tuple[int, int], bool]]:
    """``rows`` cut into runs, each with whether it lies in ``written`` (sorted, disjoint spans)."""
    runs, at = [], rows[0]
    for a, b in written:
        a, b = max(a, rows[0]), min(b, rows[1])
        if a < b:
            if at < a:
                runs.append(((at, a), False))
            runs.append(((a, b), True))
            at = b
    if at < rows[1]:
        runs.append(((at, rows[1]), False))
    return runs


def with_written(written: Sequence[tuple[int, int]], rows: tuple[int, int]) -> list[tuple[int, int]]:
    """``written`` with ``rows`` added, sorted, disjoint and merged."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted([*written, rows]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def first_key_rows(tasks: Sequence[Sequence[BlockTask]], kv_rows: int) -> tuple[list[list[int]], int]:
    """How a member's dK/dV sums start (``rotation.KeySums``): per step and task, how many of its key rows its
    block writes first (at step 0, where the member's own sum starts; a later step's blocks add into a sum
    that arrived or exists), and how many of the ``kv_rows`` rows no step-0 block writes (zeroed)."""
    written: list[tuple[int, int]] = []
    first = [[0] * len(step) for step in tasks]
    for i, t in enumerate(tasks[0] if tasks else ()):
        first[0][i] = sum(b - a for (a, b), seen in runs_written(t.kv, written) if not seen)
        written = with_written(written, t.kv)
    return first, kv_rows - sum(b - a for a, b in written)
