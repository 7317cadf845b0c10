"""The one ring executor: walk a rotation, run each step's block tasks, merge into (out, lse).

Forward: every task's ``(out, lse)`` is written, held or merged as its query rows need
(``results.ResultPlan``): rows one block writes are that block's, rows more blocks meet are merged in
fp32 (fp64 for fp64 input) and rounded once into the result. Backward
re-walks the same rotation and recomputes each block from the saved final ``(out, lse)`` (no O(s^2)
state), sending dK/dV home through the rotation. Every scheme (p2p, a2a, all_gather, hierarchical)
runs through this loop with a different rotation. Kernels read ``[b, h, s, d]`` views of the
``[s, b, h, d]`` inputs (no layout copies) and take GQA natively where they can. Keys and values
keep their own head dims (MLA: ``dqk != dv``). An attention sink (softmax offset) is merged once
into the final ``(out, lse)``, so every block's backward already sees sink-normalised probabilities.
On a CUDA device the work after each call (merges, dQ sums) runs on a second stream while the next call
computes (``streams``); dK/dV sums stay on the calls' stream, which sends them on.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol, Sequence

import torch

from ..kernels import Dropout, Kernel, accum_dtype, finite_lse_for_backward
from ..merge import add_blocks_, add_sink_, merge_blocks_, sink_grad
from ..schedule import BlockTask
from .. import trace
from .calls import Call, backward_call, calls_for, forward_call, pass_gpu
from .packing import packed_columns, split_kv
from .results import DQ_ARITY, FIRST, FOLD, FOLD_LAST, HOLD, OWN, Piece, ResultPlan, most_blocks_per_key
from .rotation import HeldRows, Rotation, rows_of
from .streams import streams_for


class StepRunner(Protocol):
    """How a plan's step runs when not eagerly (``graphs.StepGraphs``: replayed from CUDA graphs): the
    same contract as ``ring_forward`` and ``ring_backward``, which it runs once to capture."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: "RingPlan",
                sink: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, plan: "RingPlan", sink: Optional[torch.Tensor]) -> tuple: ...


@dataclass(frozen=True)
class RingPlan:
    """What one member executes: its tasks per ring step, how shards arrive, and the kernel.

    ``results`` (how each call's out rows are written, merged or held: ``results.ResultPlan``; the forward
    with a sink uses ``sink_results``, every row through fp32), ``dq_results`` (the same for dQ, merged fewer
    blocks at a time: ``results.DQ_ARITY``) and ``kv_sums_exact`` are derived from ``tasks`` once
    (``RingPlan.build``). ``kv_sums_exact``: every dK/dV sum is complete on this member
    (``rotation.complete_sums``) and adds at most two blocks, so summing in the inputs' half precision rounds
    exactly as fp32 then one cast would (two bf16 numbers add exactly in fp32 arithmetic before the one
    rounding): the all-gather's plans, whose fp32 dK/dV buffer over the whole sequence was the largest
    thing they held. ``runner``: how the step runs (None: eagerly, ``ring_forward``/``ring_backward``; a
    ``StepRunner`` such as ``graphs.StepGraphs``: replayed from captured CUDA graphs)."""

    tasks: Sequence[Sequence[BlockTask]]
    rotation: Rotation
    kernel: Kernel
    scale: float
    results: ResultPlan
    sink_results: ResultPlan
    dq_results: ResultPlan
    dropout_p: float = 0.0
    dropout_seed: Optional[int] = None  # already distinct per rank; mixed with step and task here
    kv_sums_exact: bool = False
    runner: Optional[StepRunner] = None

    @property
    def merges(self) -> bool:
        """Some query row meets more than one block."""
        return self.results.merges

    @classmethod
    def build(cls, tasks, rotation, kernel: Kernel, scale: float, rows: int, dropout_p: float = 0.0,
              dropout_seed: Optional[int] = None) -> "RingPlan":
        exact = rotation.complete_sums and most_blocks_per_key(tasks) <= 2
        return cls(tasks, rotation, kernel, scale, ResultPlan.build(tasks, rows),
                   ResultPlan.build(tasks, rows, through=True), ResultPlan.build(tasks, rows, arity=DQ_ARITY),
                   dropout_p, dropout_seed, exact)

    def with_dropout_seed(self, seed: Optional[int]) -> "RingPlan":
        return dataclasses.replace(self, dropout_seed=seed)

    @functools.cached_property
    def _pairs_per_call(self) -> float:
        pairs = [t.useful_pairs for step in self.tasks for t in step if t.useful_pairs]
        return sum(pairs) / len(pairs) if pairs else 0.0

    def call_flops(self, parallel: int, dqk: int, dv: int) -> float:
        """Forward FLOPs of the mean attention call with work (2 (dqk + dv) a visible pair, ``parallel`` =
        batch x heads): what decides whether the work after each call goes on a side stream
        (``streams.side_stream_pays``)."""
        return 2 * (dqk + dv) * parallel * self._pairs_per_call

    def kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype dK/dV are summed in for inputs of ``dtype``."""
        return dtype if self.kv_sums_exact and dtype in (torch.bfloat16, torch.float16) else accum_dtype(dtype)

    def dropout(self, step: int, task: int) -> Optional[Dropout]:
        if self.dropout_p == 0.0:
            return None
        return Dropout(self.dropout_p, hash((self.dropout_seed, step, task)) & (2**63 - 1))


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 2, 0, 3)


def _token_major(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``x [b, h, s, d]`` as an ``[s, b, h, d]`` view when its storage is token-major and packed (the
    executor's accumulators; a fused op's output for token-major inputs), else None."""
    y = x.permute(2, 0, 1, 3)
    return y if y.is_contiguous() else None


def _sbhd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [b, h, s, d]`` as an ``[s, b, h, d]``-contiguous tensor of ``dtype``: a view when ``x`` is already
    that (a result written straight in the inputs' dtype), else one copy kernel (transpose and cast together)."""
    same = _token_major(x) if x.dtype == dtype else None
    if same is not None:
        return same
    b, h, s, d = x.shape
    out = x.new_empty((s, b, h, d), dtype=dtype)
    _copy_(_bhsd(out), x)
    return out


def _sbhd_view(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [b, h, s, d]`` as ``[s, b, h, d]``: a view when it is already in ``dtype``, else ``_sbhd``'s copy."""
    return x.permute(2, 0, 1, 3) if x.dtype == dtype else _sbhd(x, dtype)


def _kv_results(dk: torch.Tensor, dv: torch.Tensor, k_dtype: torch.dtype, v_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV ``[b, h_kv, n, ...]`` as ``[s, b, h, d]`` in the inputs' dtypes. Where they are the columns of
    the gradient walk's packed buffer they stay columns of one token-major buffer (strided views, no
    packing copy: a packed move hands the buffer on as it is, ``packing.unpacked``), cast in one kernel
    when the sums ran in fp32; else each as ``_sbhd_view`` gives it."""
    both = packed_columns(dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)) if k_dtype == v_dtype else None
    if both is None:
        return _sbhd_view(dk, k_dtype), _sbhd_view(dv, v_dtype)
    return split_kv(_sbhd(_bhsd(both), k_dtype), dk.shape[-1])


# Rows are taken with ``narrow`` (``rotation.rows_of``) and copied with the aten op: Python indexing,
# ``Tensor.copy_`` and ``Tensor.contiguous`` take a device guard that fake CUDA tensors on a CPU-only torch
# (the rehearsal, tests/test_cuda_rehearsal.py) do not have.
_copy_ = torch.ops.aten.copy_.default


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _accumulator(like: torch.Tensor, shape: tuple, dtype: torch.dtype, fill: float, covered: bool) -> torch.Tensor:
    """An accumulator of ``shape`` on ``like``'s device: uninitialised when every row gets a first write.

    A ``[b, h, s, d]`` accumulator is stored token-major (``[s, b, h, d]``, viewed): the order of the
    inputs and of the fused ops' outputs, so the merges, adds and the final copy stream through memory
    in the same order as what they read (a transposed read or write ran the merge at a third of the
    memory bandwidth on an H200)."""
    stored = (shape[2], shape[0], shape[1], shape[3]) if len(shape) == 4 else shape
    x = like.new_empty(stored, dtype=dtype) if covered else like.new_full(stored, fill, dtype=dtype)
    return _bhsd(x) if len(shape) == 4 else x


def _adopt_lse(l: torch.Tensor, rows: int, dtype: torch.dtype) -> bool:
    """Whether a first block's ``lse`` can serve as the accumulator itself (no copy): it covers every row,
    is in the accumulator dtype and is packed (a fused op's fresh output)."""
    return l.shape[-1] == rows and l.dtype == dtype and l.is_contiguous()


class _BackwardLse:
    """The final ``lse`` as each block's backward reads it: ``-inf`` made ``+inf`` (fully masked rows get
    zero probabilities, never NaN) and packed, one kernel per distinct query span (a fused op's backward
    wants its ``lse`` rows contiguous; a narrowed ``[b, h, s]`` is not)."""

    def __init__(self, lse: torch.Tensor):
        self.lse, self.spans = lse, {}

    def rows(self, span: tuple[int, int]) -> torch.Tensor:
        if span not in self.spans:
            self.spans[span] = finite_lse_for_backward(self.lse.narrow(2, span[0], span[1] - span[0]))
        return self.spans[span]


class _Sums:
    """One pass's result, its accumulator rows and the first blocks it holds (``results.ResultPlan``).

    ``out``: the result ``[b, h, s, d]`` in ``dtype``: the output of the call the plan adopts (``offer``) when
    it is token-major (no buffer, no copy), else a token-major buffer made at the first write. ``acc``:
    the accumulator-dtype rows ``plan.accumulator`` (starting at row ``base``), made at the first sum; the
    result itself when ``dtype`` is the accumulator dtype (fp32 and fp64 inputs, or every row through fp32).
    ``held``: block outputs whose rows a later call reads, until it has."""

    def __init__(self, plan: ResultPlan, like: torch.Tensor, shape: tuple, dtype: torch.dtype,
                 acc_dtype: torch.dtype):
        self.plan, self.like, self.shape, self.dtype, self.acc_dtype = plan, like, shape, dtype, acc_dtype
        self.out: Optional[torch.Tensor] = None
        self.acc: Optional[torch.Tensor] = None
        self.base = 0
        self.held: dict[tuple[int, int], tuple[int, tuple[torch.Tensor, ...]]] = {}

    def offer(self, step: int, task: int, block: torch.Tensor) -> None:
        """Adopt a call's output as the result where the plan says so and its dtype and layout allow."""
        if (step, task) == self.plan.adopted and block.dtype == self.dtype and _token_major(block) is not None:
            self.out = block

    def result(self, rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """The result's rows ``rows`` (all of it for None), made zeroed where some row is never written."""
        if self.out is None:
            self.out = _accumulator(self.like, self.shape, self.dtype, 0.0, self.plan.covered)
        return self.out if rows is None else rows_of(self.out, rows)

    def _accumulator(self) -> torch.Tensor:
        if self.acc is None:
            span = self.plan.accumulator
            if span is None or self.dtype == self.acc_dtype:
                self.acc = self.result()
            else:
                b, h, _, d = self.shape
                self.acc = _accumulator(self.like, (b, h, span[1] - span[0], d), self.acc_dtype, 0.0, True)
                self.base = span[0]
        return self.acc

    def sum(self, rows: tuple[int, int]) -> torch.Tensor:
        return rows_of(self._accumulator(), (rows[0] - self.base, rows[1] - self.base))

    def ready(self, pieces: Sequence[Piece]) -> None:
        """Make the buffers ``pieces`` write, on the current (main) stream (``streams``: what the side
        stream writes is never allocated there)."""
        for p in pieces:
            if p.role in (OWN, FIRST, FOLD_LAST):
                self.result()
            if p.role == FOLD or p.summed:
                self._accumulator()

    def folded(self, p: Piece, block: tuple[torch.Tensor, ...], with_sum: tuple[torch.Tensor, ...] = ()
               ) -> list[torch.Tensor]:
        """What ``p`` merges on its rows, in order: the sum so far (followed by ``with_sum``: its lse rows
        forward), the held blocks' tensors and ``block``'s (each call's outputs in turn: ``out, lse`` forward,
        ``dq`` backward)."""
        parts: list[torch.Tensor] = [self.sum(p.rows), *with_sum] if p.summed else []
        for key in p.held:
            q0, blocks = self.held[key]
            parts.extend(rows_of(x, (p.rows[0] - q0, p.rows[1] - q0)) for x in blocks)
        return parts + list(block)

    def target(self, p: Piece) -> torch.Tensor:
        """Where ``p`` writes its rows: the fp32 sum (``FOLD``) or the result."""
        return self.sum(p.rows) if p.role == FOLD else self.result(p.rows)

    def after(self, step: int, task: int, q0: int, *blocks: torch.Tensor) -> None:
        """Hold this call's outputs if a later call reads them; drop what no later call reads."""
        if (step, task) in self.plan.holders:
            self.held[(step, task)] = (q0, blocks)
        for key in self.plan.releases[step][task]:
            del self.held[key]


def _forward_piece(p: Piece, q0: int, o: torch.Tensor, l: torch.Tensor, sums: _Sums, lse: torch.Tensor) -> None:
    """What one call's output does on rows ``p.rows`` (``results``: write, hold, merge)."""
    if p.role == HOLD:  # read by a later call
        return
    src = (p.rows[0] - q0, p.rows[1] - q0)
    bo, bl, lse_rows = rows_of(o, src), rows_of(l, src), rows_of(lse, p.rows)
    if p.role in (OWN, FIRST):  # FIRST: every row goes through fp32, where the result is the accumulator
        if o is not sums.out:
            _copy_(sums.result(p.rows), bo)
        if l is not lse:
            _copy_(lse_rows, bl)
        return
    merge_blocks_(sums.target(p), lse_rows, *sums.folded(p, (bo, bl), (lse_rows,)))  # the sum's lse: the final's


def _backward_piece(p: Piece, q0: int, gq: torch.Tensor, sums: _Sums) -> None:
    """What one call's dQ does on rows ``p.rows``: the additive twin of ``_forward_piece``."""
    if p.role == HOLD:
        return
    bg = rows_of(gq, (p.rows[0] - q0, p.rows[1] - q0))
    if p.role == OWN:
        _copy_(sums.result(p.rows), bg)
    else:
        add_blocks_(sums.target(p), *sums.folded(p, (bg,)))


def _in_task_order(calls: Sequence[Call], run: Callable[[Call], list]) -> Iterator[tuple]:
    """Each task's outputs in task order (what ``results`` orders a step's writes, holds and merges by), the
    calls run in their own: a stacked call's later tasks wait for the tasks before them (``calls``). With one
    call per task, each task's outputs as its call returns them."""
    pending: dict[int, tuple] = {}
    ready = 0
    for call in calls:
        for i, *outputs in run(call):
            pending[i] = tuple(outputs)
        while ready in pending:
            yield (ready, *pending.pop(ready))
            ready += 1


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan,
                 sink: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [sq, b, h, dqk]``, ``k [sk, b, h_kv, dqk]``, ``v [sk, b, h_kv, dv]`` -> ``out [sq, b, h, dv]``
    (q's dtype) and ``lse [b, h, sq]`` (accumulator dtype). ``sink [h]``: a per-head attention sink
    (softmax offset), merged once into the final result (``merge.add_sink_``).

    Work outside the attention calls (``results``): rows one block writes take its output as it is (one
    copy, none where the first call covers every row: its output is the result); a row two blocks meet is
    one fused merge into the result; a row more blocks meet is merged in an fp32 accumulator over just those
    rows, the last merge writing the result. ``lse`` is the first call's own when it covers every row. With
    a sink every row goes through fp32 and one copy writes the result after the sink's merge."""
    qb = _bhsd(q)
    acc = accum_dtype(q.dtype)
    b, h, sq, _ = qb.shape
    results = plan.results if sink is None else plan.sink_results
    sums = _Sums(results, qb, (b, h, sq, v.shape[-1]), acc if results.through else q.dtype, acc)
    lse: Optional[torch.Tensor] = None
    streams = streams_for(qb, plan.call_flops(b * h, qb.shape[-1], v.shape[-1]))
    gpu, held = pass_gpu(qb, plan.dropout_p > 0), HeldRows(qb)
    for step, kb, vb in plan.rotation.blocks(_bhsd(k), _bhsd(v)):
        t0 = trace.now()
        tasks = plan.tasks[step]
        run = functools.partial(forward_call, plan.kernel, tasks=tasks, q=qb, k=kb, v=vb, scale=plan.scale,
                                dropout=functools.partial(plan.dropout, step), rows=held)
        for i, o, l in _in_task_order(calls_for(tasks, b * h, gpu, True), run):
            t = tasks[i]
            sums.offer(step, i, o)
            if lse is None:
                lse = l if _adopt_lse(l, sq, acc) else _accumulator(qb, (b, h, sq), acc, float("-inf"), results.covered)
            pieces = results.pieces[step][i]
            sums.ready(pieces)
            if not (o is sums.out and l is lse):  # else the call's outputs are the results: nothing to do
                with streams.after(o, l):
                    for p in pieces:
                        _forward_piece(p, t.q[0], o, l, sums, lse)
            sums.after(step, i, t.q[0], o, l)
        trace.record("forward_compute", step, t0)
    streams.join()
    if lse is None:  # no task at all (every row masked): zeros, lse -inf
        lse = qb.new_full((b, h, sq), float("-inf"), dtype=acc)
    if sink is not None:
        add_sink_(sums.result(), lse, sink)
    return _sbhd(sums.result(), q.dtype), lse


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, plan: RingPlan, sink: Optional[torch.Tensor] = None):
    """The gradients ``dq, dk, dv`` (the inputs' dtypes) and ``dsink`` (``sink``'s dtype, or None) from the
    final ``out [sq, b, h, dv]`` and ``lse [b, h, sq]`` of ``ring_forward``: every block is recomputed and
    its dK/dV travel home through the rotation. With a sink, ``out``/``lse`` already include it, so each
    block's probabilities are the sink-normalised ones and no block needs to know about it.

    Work outside the attention calls: one kernel per distinct query span for the blocks' ``lse``; dQ held
    as the forward holds ``out`` (``results``: the first call's dQ is the result when it covers every row,
    two blocks are one fused add into it, more are summed in fp32 over just their rows, the last add
    writing the result); one kernel per block for dK/dV (``Gradients.add``), which a gradient walk may hand
    back as a lone block gave them (``LocalGradients``)."""
    dout = _contiguous(dout.to(q.dtype))
    qb, ob, dob = _bhsd(q), _bhsd(out), _bhsd(dout)
    block_lse = _BackwardLse(lse)
    sums = _Sums(plan.dq_results, qb, tuple(qb.shape), q.dtype, accum_dtype(q.dtype))
    kb_all, vb_all = _bhsd(k), _bhsd(v)
    grads = plan.rotation.gradients(kb_all, vb_all, plan.kv_dtype(k.dtype))
    parallel = qb.shape[0] * qb.shape[1]
    streams = streams_for(qb, plan.call_flops(parallel, qb.shape[-1], v.shape[-1]))
    gpu, held = pass_gpu(qb, plan.dropout_p > 0), HeldRows(dob, qb, ob)
    for step, kb, vb in grads.blocks(kb_all, vb_all):
        t0 = trace.now()
        tasks = plan.tasks[step]
        run = functools.partial(backward_call, plan.kernel, tasks=tasks, dout=dob, q=qb, k=kb, v=vb, out=ob,
                                lse_rows=block_lse.rows, scale=plan.scale,
                                dropout=functools.partial(plan.dropout, step), rows=held)
        for i, gq, gk, gv in _in_task_order(calls_for(tasks, parallel, gpu, False), run):
            t = tasks[i]
            sums.offer(step, i, gq)
            pieces = plan.dq_results.pieces[step][i]
            sums.ready(pieces)
            if gq is not sums.out:  # else the call's dQ is the result: nothing to do
                with streams.after(gq):
                    for p in pieces:
                        _backward_piece(p, t.q[0], gq, sums)
            sums.after(step, i, t.q[0], gq)
            grads.add(step, t.kv, gk, gv)
        trace.record("backward_compute", step, t0)
        grads.done(step)
        del kb, vb  # the walk frees a shard's message once it is sent, not when the next one arrives
    streams.join()
    dk, dv = grads.result()
    dsink = None if sink is None else sink_grad(dob, ob, finite_lse_for_backward(lse), sink).to(sink.dtype)
    return (_sbhd(sums.result(), q.dtype), *_kv_results(dk, dv, k.dtype, v.dtype), dsink)


class RingAttention(torch.autograd.Function):
    """``(q [sq, b, h, dqk], k [sk, b, h_kv, dqk], v [sk, b, h_kv, dv], plan, sink [h] or None)
    -> (out [sq, b, h, dv], lse [b, h, sq])``; differentiable in q, k, v and the sink."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, sink: Optional[torch.Tensor] = None):
        out, lse = (ring_forward if plan.runner is None else plan.runner.forward)(q, k, v, plan, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        run = ring_backward if ctx.plan.runner is None else ctx.plan.runner.backward
        dq, dk, dv, dsink = run(dout, q, k, v, out, lse, ctx.plan, sink)
        return dq, dk, dv, None, dsink
