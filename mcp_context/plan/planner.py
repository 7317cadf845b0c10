"""The planner: every valid CP layout for a model, a sequence and a machine, measured and ranked.

For each candidate (``candidates.py``) it reads load balance and masked waste from the engine's
schedule, bytes and attention memory from a dry run of the engine (``dryrun.py``), predicts the
layer's attention time with and without overlap (``cost.py``) and the memory per rank
(``model.py``), then recommends one. Ranking: layouts that fit in memory first; among them the
lowest attention time per sequence for the whole cluster (one layer's time divided by the
data-parallel size, since a smaller CP leaves more GPUs for data parallelism and the MLP's cost per
sequence does not depend on CP); near-ties (within 2 %) go to fewer inter-node bytes, then less memory.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..algorithms.schemes import member_tasks
from ..cp_rules import comm_rule
from ..masks import Mask, attention_mask
from ..schedule import Schedule, layout_schedule, load_balance, masked_waste
from .candidates import Candidate, cp_sizes_for, enumerate_candidates, heads_per_tp_rank
from .cost import Fabric, Prediction, host_seconds, predict
from .dryrun import RankShape, RankTraffic, dry_run_kernel, dry_run_rank
from ..recipes.schema import ModelConfig
from .model import checkpointed_activation_bytes, layer_working_bytes, model_state_bytes, planning_shape
from .profiles import MachineProfile

ALL_RANKS_UP_TO = 16
TIE = 0.02
SKIP_ABOVE = 2.0
"""A candidate whose host issue time alone is above this multiple of the fastest fitting layout's time per
sequence is not dry-run (``HostBound``): it cannot be recommended (nothing above ``1 + TIE`` can), and its dry
run is what the planner's minutes were spent on (a narrow window's striped layouts after an all-to-all split into
a thousand calls a rank). ``plan(dry_run_all=True)`` runs them too."""
BUSY_NOTE = 0.8
"""The recommendation says its calls are too small to fill the GPU below this busy share (``Prediction.busy``)."""
GIB = 2 ** 30


@dataclass(frozen=True)
class PlanRequest:
    model: ModelConfig
    """The model's shape; sizes left unset take megatron-core's defaults (``planning_shape``)."""
    seq_len: int
    gpus: int
    profile: MachineProfile
    tp: int = 1
    pp: int = 1
    micro_batch_size: int = 1
    causal: bool = True
    dtype: torch.dtype = torch.bfloat16
    cp_sizes: Optional[tuple[int, ...]] = None
    """Only these context_parallel_sizes (default: every one that divides gpus / (tp * pp))."""
    window_size: Optional[tuple[int, int]] = None
    """The attention layer's sliding window ``(left, right)``; default: the model's ``window_size``
    (``(-1, -1)`` plans a layer without one)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", planning_shape(self.model))
        if self.window_size is None and self.model.window_size is not None:
            object.__setattr__(self, "window_size", tuple(self.model.window_size))
        for name in ("seq_len", "gpus", "tp", "pp", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.model.num_layers % self.pp:
            raise ValueError(f"num_layers={self.model.num_layers} is not divisible by pipeline_model_parallel_size="
                             f"{self.pp}; choose a PP size that divides it")
        self.mask  # a bad window is refused here, before any dry run

    @property
    def mask(self) -> Mask:
        """The attention mask every candidate is planned with (causal or full, with the window)."""
        return attention_mask(self.causal, self.window_size)


@dataclass
class PlanRow:
    """One candidate's figures (bytes and memory per rank, times per layer)."""

    candidate: Candidate
    data_parallel_size: int
    load_balance: float
    masked_waste: float
    ring_steps: int
    """Ring steps (P / all-to-all degree); with a window some of them have nothing to compute."""
    ring_steps_with_work: int
    """Steps with work for the busiest member: the others are skipped, compute and transfer."""
    forward_bytes: dict[str, int]
    backward_bytes: dict[str, int]
    intra_node_bytes: int
    inter_node_bytes: int
    prediction: Prediction
    attention_saved_bytes: int
    attention_peak_bytes: int
    activation_bytes: int
    model_state_bytes: int
    fits: bool
    dry_run_ranks: list[int] = field(default_factory=list)
    replayable: bool = False
    """Every rank's step can be replayed from CUDA graphs (``RankTraffic.captures``: K/V local to the step)."""

    @property
    def seconds_per_sequence(self) -> float:
        """One layer's attention (fwd+bwd, overlapped, or the host's issue time where longer) per sequence for
        the whole cluster."""
        return self.prediction.bound_s / self.data_parallel_size

    @property
    def memory_bytes(self) -> int:
        return self.activation_bytes + self.model_state_bytes

    def bytes_by_level(self) -> dict[str, int]:
        """Forward+backward bytes per rank: level 0 (all-to-all), the outer levels (ring), all-gather."""
        both = {op: self.forward_bytes.get(op, 0) + self.backward_bytes.get(op, 0)
                for op in set(self.forward_bytes) | set(self.backward_bytes)}
        return {"level0_all_to_all": both.get("all_to_all", 0),
                "outer_ring": both.get("ring_kv", 0) + both.get("ring_dkv", 0),
                "all_gather": both.get("all_gather", 0) + both.get("reduce_scatter", 0)}


@dataclass
class Plan:
    request: PlanRequest
    rows: list[PlanRow]
    rejected: list[tuple[Candidate, str]]
    recommended: Optional[PlanRow]
    reasons: list[str]
    skipped: list["HostBound"] = field(default_factory=list)
    """Candidates not dry-run: their host issue time alone rules them out (``SKIP_ABOVE``), slowest last."""


@dataclass(frozen=True)
class HostBound:
    """What a candidate's row is known to be before its dry run: the busiest dry-run rank's attention calls and
    the host's time to issue them (``cost.host_issue_seconds``, the row's ``host`` figure, from the same
    tasks), which its time per sequence cannot be below (``Prediction.bound_s``)."""

    candidate: Candidate
    calls: int
    host_s: float
    data_parallel_size: int

    @property
    def seconds_per_sequence(self) -> float:
        """A lower bound of the row's ``seconds_per_sequence``."""
        return self.host_s / self.data_parallel_size


def dry_run_ranks(cp_size: int, tp: int, gpus_per_node: int) -> list[int]:
    """Every CP rank up to ``ALL_RANKS_UP_TO``; beyond, the ranks on the first and the last node
    (where the ring wraps round and where every kind of peer pair already occurs)."""
    if cp_size <= ALL_RANKS_UP_TO:
        return list(range(cp_size))
    per_node = max(gpus_per_node // tp, 1)
    return sorted(set(range(min(per_node, cp_size))) | set(range(max(cp_size - per_node, 0), cp_size)))


def rank_shape(req: PlanRequest) -> RankShape:
    heads, kv_heads = heads_per_tp_rank(req.model.num_attention_heads, req.model.num_query_groups, req.tp)
    return RankShape(req.seq_len, req.micro_batch_size, heads, kv_heads, req.model.kv_channels, req.dtype,
                     req.model.v_head_dim)


def host_bound(req: PlanRequest, cand: Candidate) -> HostBound:
    """``cand``'s host issue time from its tasks alone (no dry run): the calls of its busiest ``dry_run_ranks``
    rank, whose tasks the engine builds the same way (``schemes.member_tasks``)."""
    shape = rank_shape(req)
    schedule = layout_schedule(cand.layout, cand.cp_size, req.seq_len, req.mask, cand.a2a_degree,
                               dry_run_kernel(shape).capabilities.masks)
    kv = comm_rule(cand.engine_comm).kv
    members = {r // cand.a2a_degree for r in dry_run_ranks(cand.cp_size, req.tp, req.profile.gpus_per_node)}
    calls = max(sum(1 for step in member_tasks(kv, schedule, m, schedule.kernel_masks) for task in step
                    if task.useful_pairs) for m in members)
    return HostBound(cand, calls, host_seconds(req.profile, calls), req.gpus // (req.tp * req.pp * cand.cp_size))


def evaluate(req: PlanRequest, cand: Candidate, ranks: Optional[list[int]] = None) -> PlanRow:
    """All figures of one candidate (dry run on ``ranks``, default ``dry_run_ranks``)."""
    shape = rank_shape(req)
    fabric = Fabric(req.profile, req.tp)
    ranks = ranks if ranks is not None else dry_run_ranks(cand.cp_size, req.tp, req.profile.gpus_per_node)
    traffics: list[RankTraffic] = [dry_run_rank(cand.engine_comm, cand.sizes, cand.layout, req.mask, shape, r,
                                                req.profile.gpu) for r in ranks]
    schedule = layout_schedule(cand.layout, cand.cp_size, req.seq_len, req.mask, cand.a2a_degree)
    splits = [fabric.split(tr, {op: tr.forward.get(op, 0) + tr.backward.get(op, 0)
                                for op in set(tr.forward) | set(tr.backward)}) for tr in traffics]
    worst = max(range(len(traffics)), key=lambda i: (splits[i][1], sum(splits[i])))
    s_local = req.seq_len // cand.cp_size
    dp = req.gpus // (req.tp * req.pp * cand.cp_size)
    peak = max(tr.peak_bytes for tr in traffics)
    activation = (checkpointed_activation_bytes(req.model, s_local, req.micro_batch_size, req.tp, req.pp)
                  + layer_working_bytes(req.model, s_local, req.micro_batch_size, req.tp) + peak)
    state = model_state_bytes(req.model, req.tp, req.pp, dp * cand.cp_size)
    return PlanRow(cand, dp, load_balance(schedule), masked_waste(schedule), schedule.ring_size,
                   steps_with_work(schedule), traffics[worst].forward,
                   traffics[worst].backward, *splits[worst],
                   predict(shape, cand.a2a_degree, traffics, fabric),
                   max(tr.saved_bytes for tr in traffics), peak, activation, state,
                   activation + state <= req.profile.memory_gib * GIB, list(ranks),
                   all(tr.captures for tr in traffics))


def steps_with_work(schedule: Schedule) -> int:
    """Ring steps at which the busiest member has a block to compute (the rest are skipped)."""
    return max(sum(1 for step in member if step) for member in schedule.tasks)


def _choose(rows: list[PlanRow]) -> PlanRow:
    """Among layouts that fit: the fastest per sequence, near-ties (within ``TIE``) to fewer inter-node
    bytes, then less memory. When none fits: the least memory, near-ties to the fastest."""
    fitting = [r for r in rows if r.fits]
    if fitting:
        fastest = min(r.seconds_per_sequence for r in fitting)
        close = [r for r in fitting if r.seconds_per_sequence <= fastest * (1 + TIE)]
        return min(close, key=lambda r: (r.inter_node_bytes, r.memory_bytes))
    least = min(r.memory_bytes for r in rows)
    close = [r for r in rows if r.memory_bytes <= least * (1 + TIE)]
    return min(close, key=lambda r: (r.seconds_per_sequence, r.inter_node_bytes))


LOG_LINE_SECONDS = 60.0
"""Where stderr is not a terminal (a batch job's log), ``plan(progress=None)`` writes a progress line at
most this often instead of a bar: a 64-rank plan runs for minutes."""


class _LogLines:
    """Progress as plain lines on stderr, at most one every ``every`` seconds: ``dry runs: 12/103 candidates,
    65 s``."""

    def __init__(self, total: int, every: float):
        self.total, self.every, self.done = total, every, 0
        self.start = self.last = time.monotonic()

    def update(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last >= self.every and self.done < self.total:
            self.last = now
            print(f"dry runs: {self.done}/{self.total} candidates, {now - self.start:.0f} s", file=sys.stderr,
                  flush=True)


def plan(req: PlanRequest, progress: Optional[bool] = False, jobs: Optional[int] = 1, dry_run_all: bool = False
         ) -> Plan:
    """Evaluate every valid candidate and recommend one (listed first; the rest: fitting ones first,
    fastest per sequence first). Candidates are dry-run in the order of their host issue time, and one whose
    host time alone is above ``SKIP_ABOVE`` times the fastest fitting row so far is not (``Plan.skipped``)
    unless ``dry_run_all``. ``progress``: a bar over the candidates on stderr (None: a bar on a terminal, else
    a line at most every ``LOG_LINE_SECONDS``). ``jobs`` > 1 runs the candidates' dry runs in that many worker
    processes; None: ``auto_jobs``."""
    from tqdm import tqdm

    shape = rank_shape(req)
    sizes = _cp_sizes(req)
    valid, rejected = enumerate_candidates(sizes, req.seq_len, shape.heads, shape.kv_heads)
    if jobs is None:
        jobs = auto_jobs(sizes, usable_cpus())
    skip_above = math.inf if dry_run_all else SKIP_ABOVE
    if progress is None and not sys.stderr.isatty():
        rows, skipped = _evaluate_all(req, valid, jobs, _LogLines(len(valid), LOG_LINE_SECONDS).update, skip_above)
    else:
        with tqdm(total=len(valid), desc="dry runs", unit="candidate", disable=progress is False) as bar:
            rows, skipped = _evaluate_all(req, valid, jobs, bar.update, skip_above)
    rows.sort(key=lambda r: (not r.fits, r.seconds_per_sequence))
    if not rows:
        return Plan(req, [], rejected, None, ["no CP layout is valid; see the rejected list for why"])
    best = _choose(rows)
    rows.remove(best)
    rows.insert(0, best)
    return Plan(req, rows, rejected, best, explain(req, best, rows, skipped), skipped)


AUTO_JOBS_MIN_CP = 16
AUTO_JOBS_MAX = 8


def auto_jobs(cp_sizes: Sequence[int], cpus: int) -> int:
    """Worker processes for ``--jobs auto``: ``cpus`` (at most ``AUTO_JOBS_MAX``) where a CP size of
    ``AUTO_JOBS_MIN_CP`` or more is planned (each candidate's dry run covers 16 ranks), else 1 (each worker
    imports torch first). On an idle 2-core machine, Llama-3-8B heads at 32K: CP 16 (51 candidates) took
    55-70 s in one process and 34-42 s in two (three runs each); CP 8 at 4K (27 candidates) 8.6 s in one and
    9.4 s in two."""
    return max(1, min(cpus, AUTO_JOBS_MAX)) if max(cp_sizes, default=1) >= AUTO_JOBS_MIN_CP else 1


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def runs_alike(cand: Candidate) -> tuple:
    """What a candidate's dry run and figures depend on besides the request: its engine scheme, CP size, all-to-all
    degree and layout. Hierarchies that differ only past level 0 (``[2, 2, 2]`` and ``[2, 4]`` for a2a+p2p) run the
    same step: the engine's ring spans the outer levels flattened (``algorithms/schemes``)."""
    return cand.engine_comm, cand.cp_size, cand.a2a_degree, cand.layout


def _evaluate_all(req: PlanRequest, candidates: list[Candidate], jobs: int, done: Callable[[], object],
                  skip_above: float = SKIP_ABOVE) -> tuple[list[PlanRow], list[HostBound]]:
    """``evaluate`` each candidate, in this process or in ``jobs`` fresh ones (spawned: a dry run needs a
    process without a torch.distributed default group); ``done()`` after each. Candidates that run alike
    (``runs_alike``) are evaluated once and share the figures, each row under its own candidate. Kinds are
    dry-run in the order of their ``host_bound``; once a kind's bound is above ``skip_above`` times the fastest
    fitting row's time per sequence, it and every later one are skipped. Returns the rows (in ``candidates``'
    order) and the skipped candidates' bounds (slowest last)."""
    kinds: dict[tuple, Candidate] = {}
    for cand in candidates:
        kinds.setdefault(runs_alike(cand), cand)  # the first candidate of each kind is dry-run
    bounds = sorted((host_bound(req, cand) for cand in kinds.values()), key=lambda b: b.seconds_per_sequence)
    by_kind: dict[tuple, PlanRow] = {}
    fastest = math.inf  # the fastest fitting row's seconds per sequence so far

    def record(key: tuple, row: PlanRow) -> None:
        nonlocal fastest
        by_kind[key] = row
        if row.fits:
            fastest = min(fastest, row.seconds_per_sequence)
        done()

    def wanted(bound: HostBound) -> bool:
        return bound.seconds_per_sequence <= skip_above * fastest

    queue = [(runs_alike(b.candidate), b) for b in bounds]
    if jobs <= 1 or len(queue) <= 1:
        while queue and wanted(queue[0][1]):
            key, bound = queue.pop(0)
            record(key, evaluate(req, bound.candidate))
    else:
        import multiprocessing
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        with ProcessPoolExecutor(min(jobs, len(queue)), mp_context=multiprocessing.get_context("spawn")) as pool:
            running: dict = {}
            while running or (queue and wanted(queue[0][1])):
                while queue and len(running) < jobs and wanted(queue[0][1]):
                    key, bound = queue.pop(0)
                    running[pool.submit(evaluate, req, bound.candidate)] = key
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    record(running.pop(future), future.result())
    # worker processes may have dry-run a kind before a faster row ruled it out; one process never does (each kind
    # it runs is within skip_above of every row it finds), so those are listed as skipped, as it lists them
    skipped_bounds = [(key, bound) for key, bound in ((runs_alike(b.candidate), b) for b in bounds)
                      if key not in by_kind or not wanted(bound)]
    skipped_kinds = {key for key, _ in skipped_bounds}
    rows = []
    for cand in candidates:
        key = runs_alike(cand)
        if not (key in by_kind and kinds[key] == cand):  # record() counted the ones dry-run
            done()
        if key not in skipped_kinds:
            row = by_kind[key]
            rows.append(row if row.candidate == cand else dataclasses.replace(row, candidate=cand))
    skipped = [dataclasses.replace(bound, candidate=cand) for key, bound in skipped_bounds
               for cand in candidates if runs_alike(cand) == key]
    return rows, skipped


def _cp_sizes(req: PlanRequest) -> list[int]:
    possible = cp_sizes_for(req.gpus, req.tp, req.pp)
    if req.cp_sizes is None:
        return possible
    wrong = [c for c in req.cp_sizes if c not in possible]
    if wrong:
        raise ValueError(f"cp_sizes={list(req.cp_sizes)}: {wrong} do not divide gpus / (tp * pp) = "
                         f"{req.gpus // (req.tp * req.pp)}; choose from {possible}")
    return sorted(set(req.cp_sizes))


def explain(req: PlanRequest, best: PlanRow, rows: list[PlanRow], skipped: Sequence[HostBound] = ()) -> list[str]:
    """Plain-language reasons for the recommendation, with the figures they rest on (the comparisons among the
    dry-run rows; ``skipped`` are said apart)."""
    c, p, mem = best.candidate, best.prediction, req.profile.memory_gib
    reasons = []
    fitting = [r for r in rows if r.fits]
    among = "dry-run " if skipped else ""
    if not best.fits:
        least = min(rows, key=lambda r: (r.memory_bytes, r.seconds_per_sequence))
        need = "needs the least" if least.memory_bytes == best.memory_bytes else (
            f"is the fastest within {TIE:.0%} of the least ({least.candidate.label()}, "
            f"{least.memory_bytes / GIB:.1f} GiB) and needs")
        reasons.append(f"no layout fits in {mem:.0f} GiB per GPU; {c.label()} {need} "
                       f"({best.memory_bytes / GIB:.1f} GiB: {best.model_state_bytes / GIB:.1f} model state + "
                       f"{best.activation_bytes / GIB:.1f} activations); use more GPUs for a larger CP size, "
                       f"GPUs with more memory, or a shorter sequence (a larger pipeline_model_parallel_size "
                       f"shrinks the model state, not the first stage's activations: under 1F1B it holds "
                       f"{req.model.num_layers} layers' inputs whatever the PP size)")
    else:
        fits_at = {r.candidate.cp_size for r in fitting}  # a size fits when any of its layouts does
        smaller = sorted({r.candidate.cp_size for r in rows if r.candidate.cp_size < c.cp_size} - fits_at)
        if smaller:
            reasons.append(f"CP sizes {smaller} do not fit in {mem:.0f} GiB per GPU (model state + activations); "
                           f"CP {c.cp_size} needs {best.memory_bytes / GIB:.1f} GiB")
        fastest = min(fitting, key=lambda r: r.seconds_per_sequence)
        if fastest is best:
            reasons.append(f"fastest attention per sequence among the {len(fitting)} {among}layouts that fit: "
                           f"{p.bound_s * 1e3:.2f} ms forward+backward per layer with data parallel size "
                           f"{best.data_parallel_size}")
        else:
            slower = best.seconds_per_sequence / fastest.seconds_per_sequence
            if best.inter_node_bytes < fastest.inter_node_bytes:
                why = (f"fewer bytes over the network: {best.inter_node_bytes / 2**20:.1f} MiB against "
                       f"{fastest.inter_node_bytes / 2**20:.1f} MiB per layer")
            else:
                why = (f"as few bytes over the network and less memory: {best.memory_bytes / GIB:.1f} GiB against "
                       f"{fastest.memory_bytes / GIB:.1f} GiB")
            reasons.append(f"within {TIE:.0%} of the fastest per sequence among the {len(fitting)} {among}layouts that "
                           f"fit ({fastest.candidate.label()}; {slower:.3f}x its time), with {why}")
    if p.ring_step_transfer_s > 0:
        comm = (f"overlapping the ring hides {(p.total_no_overlap_s - p.total_s) * 1e3:.2f} ms "
                f"(without overlap: {p.total_no_overlap_s * 1e3:.2f} ms)")
    else:
        comm = f"no ring to overlap: {(p.total_s - p.compute_s) * 1e3:.2f} ms of communication is exposed"
    reasons.append(f"predicted {p.forward_s * 1e3:.2f} ms forward + {p.backward_s * 1e3:.2f} ms backward per layer "
                   f"({p.compute_s * 1e3:.2f} ms of it compute); {comm}")
    if p.host_s > p.total_s:
        replay = ("; or replay the step from CUDA graphs (K/V are local to it: step_graphs=True, recipe "
                  "model.cp_step_graphs=true; timed on an H200, its bit-for-bit test not yet run whole on a GPU)"
                  if best.replayable else "")
        reasons.append(f"host-bound: issuing the layer takes the host {p.host_s * 1e3:.2f} ms, longer than the GPU "
                       f"runs it ({p.total_s * 1e3:.2f} ms); the GPU waits unless the layers before attention give the "
                       f"host a lead: fewer CP ranks for this length, or a larger micro batch, gives each call more "
                       f"work{replay}")
    if p.busy < BUSY_NOTE:
        heads = rank_shape(req).heads // c.a2a_degree
        reasons.append(f"its attention calls are too small to fill the GPU: its SMs are busy {p.busy:.0%} of the "
                       f"calls' time ({heads} heads a call at micro batch {req.micro_batch_size}, one thread block per "
                       f"{req.profile.attention_tile_rows} rows; plan/cost.occupancy); fewer CP ranks for this length "
                       f"give each call more rows")
    if p.ring_step_transfer_s > 0:
        verdict = "hidden under" if p.ring_step_transfer_s <= p.ring_step_compute_s else "longer than"
        reasons.append(f"a ring step's K/V transfer ({p.ring_step_transfer_s * 1e3:.2f} ms) is {verdict} its block's "
                       f"compute ({p.ring_step_compute_s * 1e3:.2f} ms)")
    reasons.append(f"load balance {best.load_balance:.3f} (1.0 is perfect), masked waste {best.masked_waste:.4f}; "
                   f"per rank per layer {best.intra_node_bytes / 2**20:.1f} MiB over NVLink and "
                   f"{best.inter_node_bytes / 2**20:.1f} MiB over the network")
    if req.mask.window_size != (-1, -1) and req.mask.window_size != (-1, 0):
        reasons.append(f"window_size={req.mask.window_size}: {best.ring_steps_with_work} of the ring's "
                       f"{best.ring_steps} steps have work; the other {best.ring_steps - best.ring_steps_with_work} "
                       f"are skipped (no compute, no transfer)")
    pool = fitting if best.fits else rows
    fewest = min(pool, key=lambda r: r.intra_node_bytes + r.inter_node_bytes)
    sent = best.intra_node_bytes + best.inter_node_bytes
    if fewest.intra_node_bytes + fewest.inter_node_bytes < sent:
        reasons.append(f"{fewest.candidate.label()} needs fewer bytes: "
                       f"{(fewest.intra_node_bytes + fewest.inter_node_bytes) / 2**20:.1f} MiB per rank per layer "
                       f"against {sent / 2**20:.1f} MiB ({fewest.seconds_per_sequence / best.seconds_per_sequence:.3f}x "
                       f"the time per sequence)")
    others = [r for r in rows[1:] if r.fits == best.fits]
    hierarchical = [r for r in others if len(r.candidate.sizes) > 1] if len(c.sizes) == 1 else []
    for what, pool in (("runner-up", others), ("best hierarchical layout", hierarchical)):
        if pool:  # the same order the choice used: time among fitting layouts, memory otherwise
            row = pool[0] if best.fits else min(pool, key=lambda r: (r.memory_bytes, r.seconds_per_sequence))
            reasons.append(_compare(what, row, best))
    if skipped:
        first = skipped[0]
        reasons.append(f"{len(skipped)} layouts not dry-run: issuing their attention calls alone takes the host more "
                       f"than {SKIP_ABOVE:g}x this layout's time per sequence (the nearest, {first.candidate.label()}: "
                       f"{first.calls} calls a layer, at least {first.seconds_per_sequence * 1e3:.2f} ms per sequence, "
                       f"{first.seconds_per_sequence / best.seconds_per_sequence:.1f}x); --dry-run-all runs them too")
    return reasons


def _compare(what: str, row: PlanRow, best: PlanRow) -> str:
    return (f"{what} {row.candidate.label()}: {row.prediction.bound_s * 1e3:.2f} ms per layer, "
            f"{row.seconds_per_sequence / best.seconds_per_sequence:.3f}x the time per sequence, "
            f"{row.inter_node_bytes / 2**20:.1f} MiB over the network, {row.memory_bytes / GIB:.1f} GiB")


def with_gpus_per_node(profile: MachineProfile, gpus_per_node: Optional[int]) -> MachineProfile:
    return profile if gpus_per_node is None else dataclasses.replace(profile, gpus_per_node=gpus_per_node)
