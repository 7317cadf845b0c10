"""Predicted attention time of one layer, from the tasks the engine executes, the dry run's bytes and a
machine profile calibrated on measured GPU rates.

The model follows the engine step by step. A member's step takes the longer of its compute and the
step's transfer (the slowest rank's), and the layer its busiest member's steps: a member waits only for
the shard its neighbour sent as that neighbour's previous step began, so one member's slow step and the
next member's slow step a step later do not add up (a ring's members merge at different steps). A
member's compute at a step is the sum
over its block tasks (the plan the dry run resolved: a ring's tasks per step, or an all-gather's few
calls in one step) of

- the attention call: its FLOPs (``4 d`` per visible pair and head forward, 3.5x that forward+backward)
  at the rate the profile's tables give for the call's shape (causal squares by rows, full blocks by the
  causal length of equal pairs, ``sqrt(2 * pairs)``, interpolated in log length), divided by the share
  of the GPU's SMs the call keeps busy (``occupancy``: the tables are measured with calls that fill it; a
  call of few heads and rows does not), plus a fixed per-call overhead;
- the work around it (``task_bytes``): the merge or first copy of its output forward, the dQ and dK/dV
  accumulation backward, at the profile's memory bandwidth;

and once per layer the result copies and the dK/dV buffer's fill. The host issues that work at a rate of
its own (``host_issue_seconds``); the layer takes the longer of the two (``Prediction.bound_s``).

A transfer to a peer on the same node runs at the NVLink bandwidth, to another node at the network
bandwidth; a collective whose peers are on both runs on both at once (the slower part counts).

- Forward: the all-to-all / all-gather is exposed; ring step ``t`` computes while the shard for
  step ``t+1`` travels: ``sum_t max(compute_t, transfer_t)`` with overlap, the plain sum without.
- Backward: during step ``t`` the next K/V shard and the dK/dV of step ``t-1`` are in flight; the
  last dK/dV (going home) is exposed.

Bytes come from the dry run of the real comm code; only their split over steps is by count of
transfers (every ring transfer of a pass has the same size).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ..algorithms.results import (DQ_ARITY, FIRST, FOLD, HOLD, OUT_ARITY, OWN, Piece, ResultPlan, first_key_rows,
                                  most_blocks_per_key)
from ..algorithms.calls import Call, planned_calls, stacked_by_copy, task_share
from ..schedule import BlockTask
from .dryrun import RankShape, RankTraffic
from .profiles import MachineProfile

FWD_BWD_FLOP_FACTOR = 3.5  # forward + backward FLOPs over forward's (the backward recomputes the scores)


def _rate(table: Sequence[tuple[float, float, float]], length: float) -> tuple[float, float]:
    """``(forward, forward+backward)`` TFLOP/s at ``length``: log-linear between the table's rows, the end
    rows' figures beyond them."""
    lengths = [r[0] for r in table]
    i = bisect.bisect_left(lengths, length)
    if i == 0:
        return table[0][1], table[0][2]
    if i == len(table):
        return table[-1][1], table[-1][2]
    (x0, f0, b0), (x1, f1, b1) = table[i - 1], table[i]
    w = (math.log(length) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return f0 + w * (f1 - f0), b0 + w * (b1 - b0)


def occupancy(profile: MachineProfile, task: BlockTask, parallel: int) -> tuple[float, float]:
    """``(forward, backward)`` share of the GPU's SMs a fused call of ``task`` keeps busy, ``parallel`` copies
    of it (batch x heads) at once. The kernel gives each tile of ``attention_tile_rows`` rows a thread block
    (query tiles forward, key tiles backward), whose work is the tiles of the other side it visits; it takes
    at least its busiest block's time and at least the total over ``sm_count`` SMs, so the share is
    ``total / (sm_count * busiest)``, at most 1. Calls of many heads and rows fill the GPU (every row of the
    rate tables does); 4 heads of 2048 query rows give 64 blocks of equal work forward, half an H200's 132."""
    return task_share(task, parallel, profile.gpu, True), task_share(task, parallel, profile.gpu, False)


def call_seconds(profile: MachineProfile, task: BlockTask, flops_per_pair: float, parallel: int
                 ) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one task's attention call: its FLOPs at the table's rate, slowed by
    the share of the GPU it leaves idle (``occupancy``; ``parallel``: the batch x heads it runs at once),
    plus the fixed overhead once each way."""
    if task.useful_pairs == 0:
        return 0.0, 0.0
    fwd, bwd = _filled_seconds(profile, task, flops_per_pair)
    fwd_busy, bwd_busy = occupancy(profile, task, parallel)
    overhead = profile.call_overhead_us * 1e-6
    return fwd / fwd_busy + overhead, bwd / bwd_busy + overhead


def call_time(profile: MachineProfile, tasks: Sequence[BlockTask], call: Call, flops_per_pair: float, parallel: int,
              forward: bool) -> float:
    """Seconds of one attention call in one direction (``algorithms/calls.py``): its tasks' FLOPs at the
    tables' rates over the share of the GPU the call keeps busy (its tasks stacked, or one task's key parts,
    run as that many more copies: ``occupancy``), plus the fixed overhead once. The copies that stack its rows
    and the merge of key parts are ``call_bytes``."""
    members = [tasks[i] for i in call.tasks if tasks[i].useful_pairs]
    if not members:
        return 0.0
    filled = sum(_filled_seconds(profile, t, flops_per_pair)[0 if forward else 1] for t in members)
    share = task_share(members[0], parallel * len(members), profile.gpu, forward, call.key_parts)
    return filled / share + profile.call_overhead_us * 1e-6


def call_bytes(tasks: Sequence[BlockTask], call: Call, shape: RankShape, heads: int, kv_heads: int,
               forward: bool) -> int:
    """Bytes a call moves beyond its tasks' own work (``task_bytes``): rows stacked by a copy where they are not
    adjacent (``calls.stacked_by_copy``: read and write), and the merge of
    a key-split block's parts (read every part's out and lse, write the block's)."""
    e, acc, b = shape.dtype.itemsize, 8 if shape.dtype.itemsize == 8 else 4, shape.batch
    first = tasks[call.tasks[0]]
    n, m = first.q[1] - first.q[0], first.kv[1] - first.kv[0]
    if call.key_parts > 1:
        g = call.key_parts
        q_copy = 2 * g * b * n * heads * shape.head_dim * e
        merge = (g + 1) * b * n * heads * (shape.dv * e + acc)
        return q_copy + merge + (0 if b == 1 else 2 * b * m * kv_heads * (shape.head_dim + shape.dv) * e)
    if len(call.tasks) == 1:
        return 0
    count = len(call.tasks)
    q_cols = shape.head_dim if forward else shape.head_dim + 2 * shape.dv  # backward: q, dout and out
    qs = 2 * count * b * n * heads * q_cols * e if stacked_by_copy([tasks[i].q for i in call.tasks], b) else 0
    kvs = (2 * count * b * m * kv_heads * (shape.head_dim + shape.dv) * e
           if stacked_by_copy([tasks[i].kv for i in call.tasks], b) else 0)
    return qs + kvs + (0 if forward else 2 * count * b * n * heads * acc)  # the backward's lse rows, one copy


def _filled_seconds(profile: MachineProfile, task: BlockTask, flops_per_pair: float) -> tuple[float, float]:
    """``(forward, backward)`` seconds of a call's FLOPs at the table's rates (a call that fills the GPU)."""
    pairs = task.useful_pairs
    table = profile.full_tflops if task.mask.kind == "full" else profile.causal_tflops
    fwd_rate, both_rate = _rate(table, math.sqrt(2 * pairs))
    flops = pairs * flops_per_pair
    fwd = flops / (fwd_rate * 1e12)
    return fwd, FWD_BWD_FLOP_FACTOR * flops / (both_rate * 1e12) - fwd


@dataclass(frozen=True)
class Accumulation:
    """How the executor holds a plan's results (``algorithms/results.py``, ``rotation.LocalGradients``).

    Out and dQ follow the plan's ``ResultPlan``: rows one block writes are its output (none moved where the
    first call covers every row), rows more blocks meet are merged, in fp32 only where more than
    ``results.OUT_ARITY`` (out) or ``results.DQ_ARITY`` (dQ) do.
    ``through``: every row goes through an fp32 accumulator with a copy at each end, the way the engine
    measured on the H200 held every plan (``tools/calibrate_profile.MEASURED_ENGINE``; today's executor does
    so only in a forward with a sink, which the model leaves out). ``lone_kv``: one block covers every key
    row of a ring of one, whose own dK/dV are the results (no buffer, fill, add or copy); ``kv_exact``: dK/dV
    are summed in the inputs' half dtype (``RingPlan.kv_sums_exact``: a ring of one, at most two blocks a key
    row) and handed on as views of that buffer, with no result copy. ``arities``: the most partial results one
    out merge and one dQ sum read (``results.OUT_ARITY``, ``DQ_ARITY``; 2, 2: one block at a time, as the
    engine of the H200 runs up to run 4 merged)."""

    lone_kv: bool
    kv_exact: bool = False
    through: bool = False
    arities: tuple[int, int] = (OUT_ARITY, DQ_ARITY)

    @classmethod
    def of(cls, tasks: Sequence[Sequence[BlockTask]], kv_rows: int) -> "Accumulation":
        flat = [task for step in tasks for task in step]
        return cls(len(tasks) == 1 and len(flat) == 1 and flat[0].kv == (0, kv_rows),
                   len(tasks) == 1 and most_blocks_per_key(tasks) <= 2)

    def results(self, tasks: Sequence[Sequence[BlockTask]], q_rows: int) -> tuple[ResultPlan, ResultPlan]:
        """How out (forward) and dQ (backward) are held, as ``RingPlan.build`` has them."""
        return tuple(ResultPlan.build(tasks, q_rows, through=self.through, arity=a) for a in self.arities)

    def key_rows(self, tasks: Sequence[Sequence[BlockTask]], kv_rows: int) -> tuple[list[list[int]], int]:
        """Per step and task the key rows its dK/dV are written to first, and the rows zeroed
        (``results.first_key_rows``); ``through``: none written first, every row zeroed (the measured engine
        filled its dK/dV buffer and added every block)."""
        if self.through:
            return [[0] * len(step) for step in tasks], kv_rows
        return first_key_rows(tasks, kv_rows)


def _role_bytes(p: Piece) -> tuple[int, int, int]:
    """Bytes a piece moves per row, head and column of out (forward) or dQ (backward), as (reads + writes) in
    units of the inputs' element size ``e`` and the accumulator's ``a``: ``(e, a)`` coefficients; and the
    ``lse`` values it reads and writes per row and head (accumulator dtype). A merge reads each block it folds
    once and the sum so far where it has one, and writes the sum (``FOLD``) or the result (``FOLD_LAST``)."""
    if p.role == HOLD:
        return 0, 0, 0
    if p.role == OWN:
        return 2, 0, 2
    if p.role == FIRST:
        return 1, 1, 2
    blocks = len(p.held) + 1
    if p.role == FOLD:
        return blocks, 1 + p.summed, blocks + 1 + p.summed
    return blocks + 1, int(p.summed), blocks + 1 + p.summed


def task_bytes(task: BlockTask, pieces: tuple[Sequence[Piece], Sequence[Piece]], adopted: bool, first_keys: int,
               shape: RankShape, heads: int, kv_heads: int, accumulation: Accumulation) -> tuple[int, int]:
    """``(forward, backward)`` bytes the executor moves around one task's call: for each of its row pieces
    (``results.Piece``; ``pieces``: out's, then dQ's) the work of its role (``_role_bytes``; the ``lse`` rows
    forward), nothing for the first call's rows when its output is the result (``adopted``), plus its dK/dV:
    written on the
    ``first_keys`` rows it writes first (read the block, write the sum's dtype: fp32, or the inputs' for
    ``kv_exact``), added on the others (read and write the sum, read the block); nothing for a lone block."""
    e = shape.dtype.itemsize
    acc = 8 if e == 8 else 4
    kv_acc = e if accumulation.kv_exact else acc
    keys = task.kv[1] - task.kv[0]
    forward = backward = 0
    for outputs, (columns, with_lse) in zip(pieces, ((shape.dv, True), (shape.head_dim, False))):
        for p in outputs:
            if adopted and p.role in (OWN, FIRST, HOLD) and (e == acc or not accumulation.through):
                continue
            rows = shape.batch * (p.rows[1] - p.rows[0]) * heads
            ce, ca, lse_rw = _role_bytes(p)
            moved = rows * (columns * (ce * e + ca * acc) + (lse_rw * acc if with_lse else 0))
            forward, backward = (forward + moved, backward) if with_lse else (forward, backward + moved)
    per_key = kv_heads * (shape.head_dim + shape.dv)
    dkv = 0 if accumulation.lone_kv else per_key * (first_keys * (e + kv_acc) + (keys - first_keys) * (e + 2 * kv_acc))
    return forward, backward + shape.batch * dkv


def layer_bytes(shape: RankShape, heads: int, kv_heads: int, tasks: Sequence[Sequence[BlockTask]], q_rows: int,
                kv_rows: int, accumulation: Accumulation, ring: bool = False) -> int:
    """Bytes of a layer's work outside the steps: the out and dQ result copies (only ``through`` an fp32
    accumulator: read fp32, write the inputs' dtype), the dK and dV result copies (none for ``kv_exact`` or
    fp32 inputs: views), the zeroing of the dK/dV rows no step-0 block writes (``Accumulation.key_rows``;
    none for a lone block), and for a ``ring`` that packs its own K and V into a message (a flat ring: K and V
    arrive as two tensors; after an all-to-all they arrive packed, ``Scheme.run``) that packing, once a pass
    (``packing.pack_kv``: read both, write the message)."""
    e = shape.dtype.itemsize
    acc = 8 if e == 8 else 4
    kv_acc = e if accumulation.kv_exact else acc
    per_row = shape.batch * kv_heads * (shape.head_dim + shape.dv)
    kv = 0 if accumulation.lone_kv else kv_rows * per_row
    zeroed = 0 if accumulation.lone_kv else accumulation.key_rows(tasks, kv_rows)[1] * per_row
    copied = accumulation.through and acc != e
    qo = shape.batch * q_rows * heads * (shape.dv + shape.head_dim) * (acc + e) if copied else 0
    packed = 2 * 2 * kv_rows * per_row * e if ring else 0
    return qo + (0 if kv_acc == e else kv * (kv_acc + e)) + zeroed * kv_acc + packed


@dataclass(frozen=True)
class Prediction:
    """Seconds for one attention layer on one rank, forward and backward, with and without overlap."""

    forward_s: float
    backward_s: float
    forward_no_overlap_s: float
    backward_no_overlap_s: float
    compute_s: float
    """Forward + backward compute alone (the lower bound)."""
    ring_step_compute_s: float = 0.0
    """Forward compute of the slowest off-diagonal ring step (what a transfer hides behind)."""
    ring_step_transfer_s: float = 0.0
    """Forward K/V transfer of one ring step (slowest rank)."""
    host_s: float = 0.0
    """The host's time to issue the layer's forward and backward (``host_issue_seconds``)."""
    busy: float = 1.0
    """Share of the attention calls' time the GPU's SMs are busy on the busiest rank (``busy_share``; 1: every
    call fills them)."""

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def bound_s(self) -> float:
        """The slower of the GPU's time and the host's: the GPU cannot run what the host has not issued yet.
        In training the layers before attention may give the host a lead (then ``total_s`` is the time);
        this takes none."""
        return max(self.total_s, self.host_s)

    @property
    def total_no_overlap_s(self) -> float:
        return self.forward_no_overlap_s + self.backward_no_overlap_s


class Fabric:
    """Where each rank's transfers go: node of a CP rank is ``tp * cp_rank // gpus_per_node``."""

    def __init__(self, profile: MachineProfile, tp: int):
        self.profile, self.tp = profile, tp

    def node(self, cp_rank: int) -> int:
        return self.tp * cp_rank // self.profile.gpus_per_node

    def intra_fraction(self, traffic: RankTraffic, op: str) -> float:
        """Share of this rank's bytes of operation ``op`` that go to peers on its own node."""
        dests = traffic.destinations.get(op, {})
        total = sum(dests.values())
        if not total:
            return 1.0
        here = self.node(traffic.cp_rank)
        return sum(b for peer, b in dests.items() if self.node(peer) == here) / total

    def seconds(self, nbytes: float, intra_fraction: float, transfers: int = 1) -> float:
        """Time for ``nbytes`` split over NVLink and the network, plus ``transfers`` latencies."""
        if nbytes <= 0:
            return 0.0
        p = self.profile
        wire = max(nbytes * intra_fraction / (p.intra_node_bandwidth_gbps * 1e9),
                   nbytes * (1 - intra_fraction) / (p.inter_node_bandwidth_gbps * 1e9))
        latency = p.intra_node_latency_us if intra_fraction == 1.0 else p.inter_node_latency_us
        return wire + transfers * latency * 1e-6

    def split(self, traffic: RankTraffic, ops: dict[str, int]) -> tuple[int, int]:
        """``(intra_node_bytes, inter_node_bytes)`` of ``ops`` (comm_stats bytes by operation)."""
        intra = sum(b * self.intra_fraction(traffic, op) for op, b in ops.items())
        return round(intra), round(sum(ops.values()) - intra)


def flops_per_pair(shape: RankShape, a2a_degree: int) -> int:
    """Forward FLOPs of one visible (query, key) pair of a rank's tasks (QK^T and PV, every head it holds:
    after an all-to-all of ``a2a_degree`` ranks its tasks have that many times the rows and that many
    times fewer heads)."""
    return 2 * (shape.head_dim + shape.dv) * shape.batch * (shape.heads // a2a_degree)


def rank_step_compute(traffics: Sequence[RankTraffic], shape: RankShape, a2a_degree: int, profile: MachineProfile,
                      accumulation: Optional[Accumulation] = None, planned: Optional[bool] = None
                      ) -> list[tuple[list[float], list[float]]]:
    """Per rank of ``traffics``, its forward and backward compute seconds at each step. ``accumulation``: how
    the results are held, by default as the executor holds them for these tasks (a calibration against steps
    measured on an older engine passes that engine's). ``planned``: None, the calls the executor makes on the
    profile's GPU (``algorithms/calls.planned_calls``: one per task unless ``MCP_CONTEXT_SIZED_CALLS=1``); True,
    the calls sized to it (``step_calls``), as steps timed with them ran (``tools/rank_step.harness`` 3 and 4);
    False: one call per task."""
    heads, kv_heads = shape.heads // a2a_degree, max(1, shape.kv_heads // a2a_degree)
    per_pair = flops_per_pair(shape, a2a_degree)
    parallel = shape.batch * heads
    bandwidth = profile.memory_bandwidth_gbps * 1e9
    ranks = []
    for tr in traffics:
        held = accumulation or Accumulation.of(tr.tasks, tr.kv_rows)
        out, dq = held.results(tr.tasks, tr.q_rows)
        first_keys = held.key_rows(tr.tasks, tr.kv_rows)[0]
        fwd, bwd = [], []
        for t, tasks in enumerate(tr.tasks):
            f = b = 0.0
            for i, task in enumerate(tasks):
                adopted = (t, i) == out.adopted
                bf, bb = task_bytes(task, (out.pieces[t][i], dq.pieces[t][i]), adopted, first_keys[t][i], shape,
                                    heads, kv_heads, held)
                f, b = f + bf / bandwidth, b + bb / bandwidth
            for forward in (True, False):
                spent = sum(call_time(profile, tasks, call, per_pair, parallel, forward)
                            + call_bytes(tasks, call, shape, heads, kv_heads, forward) / bandwidth
                            for call in planned_calls(tasks, parallel, profile.gpu, forward, planned))
                f, b = (f + spent, b) if forward else (f, b + spent)
            fwd.append(f)
            bwd.append(b)
        ranks.append((fwd, bwd))
    return ranks


def step_compute(traffics: Sequence[RankTraffic], shape: RankShape, a2a_degree: int, profile: MachineProfile,
                 accumulation: Optional[Accumulation] = None, planned: Optional[bool] = None
                 ) -> tuple[list[float], list[float]]:
    """Forward and backward compute seconds of each step, the slowest rank's at that step
    (``rank_step_compute``'s arguments)."""
    ranks = rank_step_compute(traffics, shape, a2a_degree, profile, accumulation, planned)
    return ([max(c) for c in zip(*(f for f, _ in ranks))], [max(c) for c in zip(*(b for _, b in ranks))])


def busy_share(traffics: Sequence[RankTraffic], shape: RankShape, a2a_degree: int, profile: MachineProfile) -> float:
    """The attention calls' compute time with every SM busy over their compute time as predicted
    (``occupancy``; the fixed overhead left out), on the rank whose calls take longest: below 1 where calls
    are too small to fill the GPU."""
    parallel = shape.batch * (shape.heads // a2a_degree)
    per_pair = flops_per_pair(shape, a2a_degree)
    worst, share = 0.0, 1.0
    overhead = profile.call_overhead_us * 1e-6
    for tr in traffics:
        filled = actual = 0.0
        for tasks in tr.tasks:
            for forward in (True, False):
                filled += sum(_filled_seconds(profile, t, per_pair)[0 if forward else 1]
                              for t in tasks if t.useful_pairs)
                actual += sum(call_time(profile, tasks, call, per_pair, parallel, forward) - overhead
                              for call in planned_calls(tasks, parallel, profile.gpu, forward)
                              if any(tasks[i].useful_pairs for i in call.tasks))
        if actual > worst:
            worst, share = actual, filled / actual
    return share


def _collective_seconds(fabric: Fabric, traffic: RankTraffic, ops: dict[str, int], calls: dict[str, int]) -> float:
    return sum(fabric.seconds(b, fabric.intra_fraction(traffic, op), calls.get(op, 0))
               for op, b in ops.items() if not op.startswith("ring_"))


def host_issue_seconds(profile: MachineProfile, traffics: Sequence[RankTraffic]) -> float:
    """The host's time to issue one layer's forward and backward on the busiest rank: ``host_layer_us`` plus
    ``host_call_us`` per attention call (a task with visible pairs; the host issues a call's merges, sums and
    transfers with it). On an H200's host with torch 2.11 a call costs about as much host time as a 4096-row
    causal block of 32 heads costs the GPU, so a rank with fewer tokens than that waits for its host."""
    return host_seconds(profile, max(sum(1 for step in tr.tasks for task in step if task.useful_pairs)
                                     for tr in traffics))


def host_seconds(profile: MachineProfile, calls: int) -> float:
    """The host's time to issue a layer of ``calls`` attention calls (``host_issue_seconds``)."""
    return (profile.host_layer_us + profile.host_call_us * calls) * 1e-6


def predict(shape: RankShape, a2a_degree: int, traffics: Sequence[RankTraffic], fabric: Fabric) -> Prediction:
    """Forward and backward time of one attention layer: the busiest rank of ``traffics`` over its steps, each
    step the longer of its compute and the slowest rank's transfer."""
    p = fabric.profile
    ranks = rank_step_compute(traffics, shape, a2a_degree, p)
    heads, kv_heads = shape.heads // a2a_degree, max(1, shape.kv_heads // a2a_degree)
    for tr, (_, bwd) in zip(traffics, ranks):  # the result copies and the dK/dV fill, once per layer (backward)
        bwd[-1] += layer_bytes(shape, heads, kv_heads, tr.tasks, tr.q_rows, tr.kv_rows,
                               Accumulation.of(tr.tasks, tr.kv_rows),
                               bool(tr.forward.get("ring_kv")) and a2a_degree == 1) / (p.memory_bandwidth_gbps * 1e9)
    steps = len(ranks[0][0])

    def ring_transfer(kv_fwd: bool, kv_bwd: bool, dkv: bool) -> float:
        """Slowest rank's time for one step's ring traffic of the given kinds."""
        worst = 0.0
        for tr in traffics:
            nbytes = 0.0
            if kv_fwd:
                nbytes += tr.forward.get("ring_kv", 0) / max(steps - 1, 1)
            if kv_bwd:
                nbytes += tr.backward.get("ring_kv", 0) / max(steps - 1, 1)
            if dkv:
                nbytes += tr.backward.get("ring_dkv", 0) / steps
            worst = max(worst, fabric.seconds(nbytes, fabric.intra_fraction(tr, "ring_kv")))
        return worst

    coll_fwd = max(_collective_seconds(fabric, tr, tr.forward, tr.calls_forward) for tr in traffics)
    coll_bwd = max(_collective_seconds(fabric, tr, tr.backward, tr.calls_backward) for tr in traffics)
    ringed = any(tr.forward.get("ring_kv") for tr in traffics)
    m_fwd = [ring_transfer(ringed and t < steps - 1, False, False) for t in range(steps)]
    m_bwd = [ring_transfer(False, ringed and t < steps - 1, ringed and t >= 1) for t in range(steps)]
    tail = ring_transfer(False, False, ringed)
    forward = coll_fwd + max(sum(map(max, f, m_fwd)) for f, _ in ranks)
    backward = coll_bwd + max(sum(map(max, b, m_bwd)) for _, b in ranks) + tail
    kv_bwd = [ring_transfer(False, ringed and t < steps - 1, False) for t in range(steps)]
    forward_serial = coll_fwd + max(sum(f) for f, _ in ranks) + sum(m_fwd)
    backward_serial = coll_bwd + max(sum(b) for _, b in ranks) + sum(kv_bwd) + steps * tail
    return Prediction(forward, backward, forward_serial, backward_serial, max(sum(f) + sum(b) for f, b in ranks),
                      max((c for f, _ in ranks for c in f[1:]), default=0.0), max(m_fwd, default=0.0),
                      host_issue_seconds(p, traffics),
                      busy_share(traffics, shape, a2a_degree, p))
