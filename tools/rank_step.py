"""One CP rank's attention work for any scheme, on one device: what the benchmark times and the op
counter counts.

A GPU runs one rank (NCCL refuses two ranks per GPU), so a rank's step is run with every other rank's
K/V laid out locally, the way ``resolve_scheme`` would hand them to the executor after communication:

==============  ===============  =========================================================
scheme          heads on a rank  K/V the executor reads
==============  ===============  =========================================================
p2p             h                every member's shard in member order, one per ring step
all_gather      h                the whole sequence in position order, one step
                                 (``schedule.gathered_tasks``: each query run in one call)
a2a             h / P            the whole sequence (a ring of one)
a2a+p2p         h / inner        the outer ring's shards in member order, one per step
a2a+all_gather  h / inner        the whole sequence in position order, one step
==============  ===============  =========================================================

The collectives themselves, and the all-to-all's reorder of rows around them, are not run: their
time is modelled from the bytes at stated link rates (``transfer_bytes``). Timed, counted or rehearsed
(``tools/bench_device.py``, ``tools/kernel_rates.py``'s profile, ``tools/step_ops.py``,
``tools/rehearse_memory.py``), a ring runs as the rank runs it (``RankStep.walked``): over its own shard's
K/V, through ``RingRotation`` with transfers that move nothing (``NoWireExchange``): its messages are
packed, received into fresh buffers (whose contents are left as allocated: a one-GPU timing reads them
like any data) and handed on as on the wire, and its dK/dV sums travel in them, with no buffer over every
member's rows. The schemes whose K/V cross a collective hand the executor K and V as the columns of one
packed tensor, as ``Scheme.run`` does (``kv_inputs``). ``harness()`` names this in what the timing tools write.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcp_context.algorithms.calls import Gpu, planned_calls, sized_calls_enabled  # noqa: E402
from mcp_context.algorithms.executor import RingAttention, RingPlan, StepRunner  # noqa: E402
from mcp_context.algorithms.packing import split_kv, unpacked  # noqa: E402
from mcp_context.algorithms.rotation import LocalRotation, RingRotation  # noqa: E402
from mcp_context.cp_rules import a2a_degree, comm_rule  # noqa: E402
from mcp_context.kernels import Kernel  # noqa: E402
from mcp_context.masks import Mask  # noqa: E402
from mcp_context.merge import FUSED_REGIONS  # noqa: E402
from mcp_context.schedule import gathered_tasks, layout_schedule, position_pieces  # noqa: E402

SCHEMES = ("p2p", "all_gather", "a2a", "a2a+p2p", "a2a+all_gather")


def harness() -> int:
    """What a timed rank step is (written into the timing tools' output, read by ``tools/calibrate_profile.py``):
    5, as 4 with one call per task (``MCP_CONTEXT_SIZED_CALLS`` unset or 0, the default since 2026-11-27);
    4, as 3 with a row's blocks merged several at a time (``results.OUT_ARITY``, ``DQ_ARITY``; one at a time
    before); 3, as 2 with the calls sized for the GPU's SMs (``algorithms/calls.py``: short equal tasks stacked,
    a short full block's keys split); 2 (run 4 of 2026-11-26), a ring walked over the rank's own shard
    (``RankStep.walked``) by the engine that holds results as their rows need (``algorithms/results.py``), one
    call per task; 1 (the H200 runs of 2026-11-26, which wrote no field), a ring laid out over every member's
    K/V with a dK/dV buffer over all of them, by the engine that sent every row through fp32
    (``tools/calibrate_profile.MEASURED_ENGINE``)."""
    return 4 if sized_calls_enabled() else 5


class _Received:
    def __init__(self, recv: torch.Tensor, send: torch.Tensor):
        self.recv, self.send = recv, send  # the send buffer stays alive until the transfer is waited on

    def wait(self) -> torch.Tensor:
        self.send = None
        return self.recv


class NoWireExchange:
    """Allocates what a ``RingExchange`` transfer allocates (a receive buffer like the message), sends nothing
    (so a walk over it can be captured in a CUDA graph: ``captures``)."""

    captures = True

    def __init__(self, ring_size: int, member: int):
        self.peers, self.member, self.group, self.op = list(range(ring_size)), member, None, "rehearsal"

    def start(self, send: torch.Tensor, step: int, recv: Optional[torch.Tensor] = None, parts=None) -> _Received:
        return _Received(torch.empty_like(send) if recv is None else recv, send)


@dataclass(frozen=True)
class RankStep:
    """What one rank of ``comm`` runs: its plan, its heads, and the K/V rows the plan reads."""

    comm: str
    sizes: tuple[int, ...]
    member: int
    plan: RingPlan
    heads: int
    kv_heads: int
    q_rows: int
    kv_rows: int
    useful_pairs: int
    gathered: bool   # K/V in position order (all_gather kinds), else member order
    ring_size: int   # members of the ring (1: a ring of one)
    packed_kv: bool  # K/V reach the executor as the columns of one packed tensor (moved by a collective)

    @property
    def calls(self) -> int:
        """Block tasks of one forward: its attention calls where every call fills the GPU (the backward makes as
        many; ``calls_on`` counts the calls a GPU's SMs make of them)."""
        return sum(len(step) for step in self.plan.tasks)

    def calls_on(self, gpu: Optional[Gpu], sized: Optional[bool] = None) -> float:
        """Attention calls of one forward and one backward on ``gpu``, their mean (``algorithms/calls.py``:
        tasks too small to fill it stacked, a full block's forward split by keys into one call, where ``sized``
        or, for None, ``MCP_CONTEXT_SIZED_CALLS`` says); ``calls`` off a GPU (None) or unsized."""
        if gpu is None:
            return self.calls
        return sum(len(planned_calls(step, self.heads, gpu, forward, sized))
                   for step in self.plan.tasks for forward in (True, False)) / 2

    @property
    def ring(self) -> bool:
        """K/V travel member to member (p2p, a2a+p2p), where the other kinds hold them all."""
        return not self.gathered and self.ring_size > 1

    @property
    def graphs_in_training(self) -> bool:
        """Whether the engine replays this step from CUDA graphs in training (``step_graphs``): where no
        transfer runs inside it (a walked ring's step captures here only because its transfers move nothing)."""
        return not self.ring

    def walked(self) -> tuple[RingPlan, int]:
        """The plan as the rank runs it and the K/V rows it reads: a ring's walk over its own shard
        (``ring_plan``), the other kinds' plan over the K/V they hold after their collectives."""
        return (self.ring_plan(), self.q_rows) if self.ring else (self.plan, self.kv_rows)

    def ring_plan(self) -> RingPlan:
        """The same tasks walked as the member walks its ring (``RingRotation``, transfers that move nothing):
        K/V of its own shard only (``q_rows`` rows), packed into messages as on the wire."""
        wire = NoWireExchange(self.ring_size, self.member)
        rotation = RingRotation(wire, wire, self.ring_size)
        return RingPlan.build(self.plan.tasks, rotation, self.plan.kernel, self.plan.scale, self.q_rows)


def hierarchy(comm: str, cp: int, inner: int) -> tuple[int, ...]:
    """The ``hierarchical_context_parallel_sizes`` a scheme runs with: flat for p2p/all_gather/a2a,
    ``[inner, cp / inner]`` for the hierarchical kinds."""
    return (inner, cp // inner) if comm_rule(comm).min_levels > 1 else (cp,)


def rank_step(comm: str, cp: int, seq_len: int, mask: Mask, kernel: Kernel, heads: int, kv_heads: int,
              head_dim: int, inner: int = 2, layout: str = "zigzag", rank: int = 0) -> RankStep:
    """The plan CP rank ``rank`` executes for ``comm`` (``inner``: the all-to-all degree of the
    hierarchical kinds), with the K/V of every other rank laid out locally."""
    sizes = hierarchy(comm, cp, inner)
    degree = a2a_degree(comm, sizes)
    schedule = layout_schedule(layout, cp, seq_len, mask, degree, kernel.capabilities.masks)
    member, ring = rank // degree, schedule.ring_size
    rows = seq_len // ring
    gathered = comm_rule(comm).kv == "gather" and ring > 1 and position_pieces(schedule) is not None
    if gathered:
        tasks, rotation = gathered_tasks(schedule, member, kernel.capabilities.masks), LocalRotation(0, 1)
    else:
        tasks, rotation = schedule.tasks[member], LocalRotation(member, ring)
    plan = RingPlan.build(tasks, rotation, kernel, head_dim ** -0.5, rows)
    moved = degree > 1 or (comm_rule(comm).kv == "gather" and ring > 1)  # Scheme.run packs K/V for these
    return RankStep(comm, sizes, member, plan, heads // degree, max(1, kv_heads // degree), rows, seq_len,
                    schedule.useful_pairs()[member], gathered, ring, moved)


def kv_inputs(step: RankStep, make: Callable[[int], torch.Tensor], head_dim: int,
              split: Callable = split_kv) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the rank's executor receives them: the two column ranges of one packed tensor
    ``make(2 * head_dim)`` where the scheme moves them packed (``step.packed_kv``, as ``Scheme.run`` does),
    else ``make(head_dim)`` twice. ``split``: ``packing.unpacked`` for a step autograd differentiates."""
    if step.packed_kv:
        return split(make(2 * head_dim), head_dim)
    return make(head_dim), make(head_dim)


def walked_call(step: RankStep, rand: Callable[..., torch.Tensor], head_dim: int, batch: int = 1,
                runner: Optional[StepRunner] = None) -> Callable[[bool], None]:
    """``call(backward=True)``: one forward of ``step`` (and its backward) as the timing tools run it, the plan
    walked as the rank walks it (``RankStep.walked``) over q, K/V and an output gradient made once by
    ``rand(*size)``; K/V as the rank holds them (``kv_inputs``: packed where a collective moved them).
    Gradients accumulate into the leaves, for ours and the fused baselines alike. ``runner``: how the step
    runs (``graphs.StepGraphs``: replayed from CUDA graphs; None: eagerly)."""
    plan, kv_rows = step.walked()
    plan = dataclasses.replace(plan, runner=runner)
    q = rand(step.q_rows, batch, step.heads, head_dim).requires_grad_()
    k, v = kv_inputs(step, lambda dims: rand(kv_rows, batch, step.kv_heads, dims).requires_grad_(), head_dim,
                     unpacked)
    dout = rand(step.q_rows, batch, step.heads, head_dim)

    def call(backward: bool = True) -> None:
        out, _ = RingAttention.apply(q, k, v, plan)
        if backward:
            out.backward(dout)
    return call


def captured_call(step: RankStep, rand: Callable[..., torch.Tensor], head_dim: int, batch: int = 1
                  ) -> tuple[Optional[Callable[[bool], None]], Optional[str]]:
    """``walked_call`` replayed from CUDA graphs (``graphs.StepGraphs``), its forward and backward captured
    here, before any timing: ``(call, None)``, or ``(None, the failure in one line)`` (the capture has not yet
    run on a GPU, so a timing tool reports a failure as its row's note and times the rest)."""
    from mcp_context.algorithms.graphs import StepGraphs
    from mcp_context.errors import first_line

    call = walked_call(step, rand, head_dim, batch, StepGraphs())
    try:
        call(True)
    except Exception as err:  # noqa: BLE001 - every failure is reported as it is
        # the whole chain on stderr: a capture invalidated by an earlier op fails at a later one ("operation failed
        # due to a previous error during capture", run 5's a2a+p2p at 16 and 64 ranks), and the earlier op's
        # error, where something caught it, is the chain's first
        print(f"the graphed step's capture failed ({step.comm}, sizes {list(step.sizes)}); its traceback:",
              file=sys.stderr, flush=True)
        traceback.print_exc(file=sys.stderr)
        return None, first_line(err)
    return call, None


@contextlib.contextmanager
def regions_doing_nothing() -> Iterator[None]:
    """Every fused region returns at once while inside: its call's host side stays (``tools/host_costs.py
    --bookkeeping``), and it allocates nothing, as compiled on a GPU (``tools/rehearse_memory.py
    --idle-regions``)."""
    saved = {region: region.eager for region in FUSED_REGIONS.values()}
    for region in saved:
        region.eager = lambda *args: None
    try:
        yield
    finally:
        for region, eager in saved.items():
            region.eager = eager


def transfer_bytes(comm: str, cp: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                   inner: int = 2, elem: int = 2) -> dict[str, float]:
    """Bytes one rank sends per layer, forward and backward, by scheme (bf16 activations, fp32 dK/dV as
    the ring sends them): the all-to-all of q, k, v forward and of out backward (with its gradients),
    then over the ring's members the K/V (a ring sends them forward, again backward, and the fp32 partial
    dK/dV sums; a gather sends them once forward and reduce-scatters dK/dV in the inputs' dtype)."""
    rule = comm_rule(comm)
    degree = a2a_degree(comm, hierarchy(comm, cp, inner))
    n = seq_len // cp                        # tokens per rank
    kv = 2 * n * kv_heads * head_dim * elem  # one rank's K and V (after an all-to-all: as many bytes)
    qo = n * heads * head_dim * elem         # one rank's Q (or out)
    a2a = (degree - 1) / degree * (2 * qo + kv) if degree > 1 else 0.0  # q, out and k, v; per direction
    ring = (cp // degree - 1) * kv
    backward_ring = ring if rule.kv == "gather" else 3 * ring
    return {"forward": a2a + ring, "backward": a2a + backward_ring}
