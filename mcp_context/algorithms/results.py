"""How one member holds its results: which blocks write each query row, and what each block's call
does with its rows, so the work around the attention calls is only what the rows need.

A row one block writes takes that block's output as it is (``OWN``: copied into the result, nothing
when the block's output *is* the result). A row ``n >= 2`` blocks meet is merged in the accumulator
dtype, in as few kernels as the arity allows (``OUT_ARITY`` for out, ``DQ_ARITY`` for dQ), each reading its
blocks once:

- a block is held where its call left it (``HOLD``) until a later block's call merges it;
- a ``FOLD`` merges the held blocks, its own and the sum so far (``Piece.summed``) into the fp32
  accumulator; the last block's (``FOLD_LAST``) writes the result instead: one rounding to the inputs'
  dtype. A row of up to ``arity`` blocks is merged once, by its last block's call, straight into the result.

So the fp32 accumulator spans only the rows more than ``arity`` blocks meet (``accumulator``). A zigzag
ring's member over 8 ranks keeps its step-0 output as the result and merges the 8 blocks of the half of its
rows they meet in 2 kernels (forward; 7 before); an all-gather's query run that meets two calls is merged
once, into the result.

``through=True`` (a forward with an attention sink, whose merge comes after every block's) sends every
row through an fp32 accumulator over all rows: the first block is copied in (``FIRST``), each other folds
into it at once (nothing held), and one copy writes the result after the sink.

The same bookkeeping over key rows starts a dK/dV sum (``runs_written``, ``first_key_rows``; the executor's
side is ``rotation.KeySums``): a key row's first block writes it, later ones add.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

from ..schedule import BlockTask, merged_ranges

OWN, HOLD, FOLD, FOLD_LAST, FIRST = "own", "hold", "fold", "fold_last", "first"

OUT_ARITY = 5
"""The most partial results one forward merge reads (the fp32 sum counting as one). A row's ``n`` blocks move
``2n + 2`` bytes an element (bf16: each read once, the result written once) when one kernel merges them all,
against ``10`` a block when each folds into an fp32 sum (read and write the sum, read the block), in ``n - 1``
kernels. What limits it is memory: a held block is a call's whole output, kept until the merge that reads it.
At 5 a zigzag member over 8 ranks merges its 8 blocks in 2 kernels (26 bytes an element, was 66 in 7), and
no rank's rehearsed peak over 8 ranks at 32K and 128K (Llama-3-8B heads, ``tools/rehearse_memory.py``) rises
above the highest before (0.90 of the fused call); at 8, one kernel, the last rank's rose to 1.25."""

DQ_ARITY = 3
"""``OUT_ARITY``'s counterpart for the dQ sums of the backward, lower because the backward's peak is where
the ring's dK/dV sums and messages are also held: 3 keeps every rank's rehearsed peak at 32K and 128K over 8
ranks within 0.87–0.90 of the fused call (4 took rank 3 to 1.01); a zigzag member's 8 dQ blocks are summed in
4 kernels (42 bytes an element, was 66 in 7)."""


@dataclass(frozen=True)
class Piece:
    """What one call does with rows ``rows`` of its query run: ``role``; for ``FOLD``/``FOLD_LAST`` the
    ``(step, task)`` of the held blocks it merges with its own (``held``, oldest first) and whether the fp32
    sum so far is one of them (``summed``)."""

    rows: tuple[int, int]
    role: str
    held: tuple[tuple[int, int], ...] = ()
    summed: bool = False


def _merges_now(held: int, summed: bool, last: bool, arity: int) -> bool:
    """Whether a row's block merges (rather than is held): it is the row's last, or the held blocks, its own
    and the sum so far fill a merge of ``arity``."""
    return last or held + 1 + summed == arity


def folds(n: int, through: bool = False, arity: int = OUT_ARITY) -> list[tuple[str, int, bool]]:
    """For each of the ``n`` blocks that write one row, in order: its role, how many held blocks before it it
    merges, and whether it reads the sum so far (``ResultPlan.build``'s plan of a row that ``n`` calls write,
    one a step: a merge reads at most ``arity`` partial results; the last block's writes the result)."""
    plan = ResultPlan.build([[BlockTask((0, 1), (k, k + 1))] for k in range(n)], 1, through, arity)
    return [(p.role, len(p.held), p.summed) for step in plan.pieces for p in step[0]]


@dataclass(frozen=True)
class ResultPlan:
    """Per step and task, the ``Piece`` s of its query run (``pieces[step][task]``, in row order).

    ``covered``: every row is written by some block (the result needs no fill). ``adopted``: the
    ``(step, task)`` of the first call when its query run is every row and some of it is that call's alone,
    so its output is the result itself; else None (a first call whose rows all go on to be summed is not
    kept past the sum's start: the result is made at its first write, and what the call held costs no
    memory meanwhile). ``accumulator``: the rows
    ``[a, b)`` the fp32 accumulator spans (None: no row meets more than ``OUT_ARITY`` blocks, and not
    ``through``).
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
    def build(cls, tasks: Sequence[Sequence[BlockTask]], rows: int, through: bool = False,
              arity: int = OUT_ARITY) -> "ResultPlan":
        """Each row's blocks held until a merge of ``arity`` partial results fills (``_merges_now``; ``folds``
        lists one row's), but for one thing: where a call merges a held block on some rows, it merges the other
        rows it writes that wait on that block too (into the fp32 sum), so no block is held past the first merge
        that reads it (a zigzag ring's full blocks, whose first chunk's blocks end early, would otherwise be
        held whole for the second chunk's later merge)."""
        order = [(s, i, t.q) for s, step in enumerate(tasks) for i, t in enumerate(step) if t.q[0] < t.q[1]]
        cuts = sorted({0, rows} | {r for *_, q in order for r in q})
        segments = list(zip(cuts, cuts[1:]))
        at = bisect.bisect_left
        spans = {(s, i): segments[at(cuts, q[0]):at(cuts, q[1])] for s, i, q in order}
        writers: dict[tuple[int, int], list[tuple[int, int]]] = {seg: [] for seg in segments}
        for call, mine in spans.items():
            for seg in mine:
                writers[seg].append(call)
        pending: dict[tuple[int, int], list[tuple[int, int]]] = {seg: [] for seg in segments}
        summed = dict.fromkeys(segments, False)
        seen = dict.fromkeys(segments, 0)
        pieces: list[list[list[Piece]]] = [[[] for _ in step] for step in tasks]
        into_sum = set(segments) if through else set()  # the rows some merge writes into the fp32 sum
        for (s, i), mine in spans.items():  # in call order
            last = {seg for seg in mine if seen[seg] == len(writers[seg]) - 1}
            merging = {seg for seg in mine if _merges_now(len(pending[seg]), summed[seg], seg in last, arity)}
            while True:  # a held block merged on some rows is merged on every row waiting on it here
                read = {key for seg in merging for key in pending[seg]}
                more = {seg for seg in mine if seg not in merging and read & set(pending[seg])}
                if not more:
                    break
                merging |= more
            for seg in mine:  # row order: each task's pieces come out sorted
                n = len(writers[seg])
                if through:
                    piece = Piece(seg, FIRST) if seen[seg] == 0 else Piece(seg, FOLD, (), True)
                elif n == 1:
                    piece = Piece(seg, OWN)
                elif seg in merging:
                    piece = Piece(seg, FOLD_LAST if seg in last else FOLD, tuple(pending[seg]), summed[seg])
                    pending[seg], summed[seg] = [], True
                    if seg not in last:
                        into_sum.add(seg)
                else:
                    piece = Piece(seg, HOLD)
                    pending[seg].append((s, i))
                seen[seg] += 1
                run = pieces[s][i]
                if run and run[-1].rows[1] == seg[0] and (run[-1].role, run[-1].held, run[-1].summed) == (
                        piece.role, piece.held, piece.summed):
                    run[-1] = dataclasses.replace(piece, rows=(run[-1].rows[0], seg[1]))  # one call per run
                else:
                    run.append(piece)
        last_reader: dict[tuple[int, int], tuple[int, int]] = {}
        for s, step in enumerate(pieces):
            for i, task in enumerate(step):
                for p in task:
                    for key in p.held:
                        last_reader[key] = (s, i)
        releases: list[list[list[tuple[int, int]]]] = [[[] for _ in step] for step in tasks]
        for holder, (s, i) in sorted(last_reader.items()):
            releases[s][i].append(holder)
        summed_rows = sorted(into_sum)
        accumulator = (0, rows) if through else (summed_rows[0][0], summed_rows[-1][1]) if summed_rows else None
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
    return merged_ranges([*written, rows])


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
