"""A rank's step replayed from CUDA graphs (``algorithms/graphs.py``, ``step_graphs=True``).

On the CPU: what cannot be captured is refused with its reason (a ring's or halo's transfers, dropout, a
device that is not CUDA, fake tensors, packed documents, a non-bool switch), and the static buffers and
the clones out of a replay keep K/V (and dK/dV) the columns of one packed buffer, in storage of their own.
For every scheme's walked step, with and without sinks, three calls on fresh inputs give what the eager
step gives (forward, lse and every gradient), capture once per direction, and a result is not changed by
the next replay: on the CPU in fp32 with a capture that reruns the step (``rerun``: the runner's own
bookkeeping, exactly), and on a CUDA GPU (skipped elsewhere) in bf16 with CUDA graphs, where memory after
the third call is also no more than after the second; there the engine with ``step_graphs=True`` also
gives the eager engine's results. On an H200 (run 5, 2026-11-27) 20 CUDA cases passed before the GPU
checks' step timed out; the rest have not yet run on a GPU.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mcp_context.algorithms import graphs
from mcp_context.algorithms.executor import RingAttention, RingPlan, ring_backward
from mcp_context.algorithms.halo import HaloRotation
from mcp_context.algorithms.packing import packed_columns, split_kv
from mcp_context.algorithms.rotation import RingRotation
from mcp_context.comm.primitives import RingExchange
from mcp_context.kernels import get_kernel
from mcp_context.masks import CAUSAL, SlidingWindow
from mcp_context.schedule import layout_schedule
from tests._dist import run_distributed
from tools.rank_step import SCHEMES, kv_inputs, rank_step

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
KERNEL = get_kernel("math", CPU, torch.float32)


def _plan(comm: str) -> RingPlan:
    return rank_step(comm, 8, 256, CAUSAL, KERNEL, 8, 2, 16).walked()[0]


def test_the_schemes_whose_k_v_are_local_capture_on_cuda_and_nothing_on_the_cpu():
    for comm in ("a2a", "all_gather", "a2a+all_gather"):
        assert graphs.refusal(_plan(comm), CUDA) is None, comm
        assert graphs.refusal(_plan(comm), CPU) == "CUDA graphs replay on a CUDA device, and the shards are on cpu"


def test_a_ring_or_halo_whose_transfers_cross_processes_and_dropout_are_refused():
    plan = _plan("p2p")
    wire = RingExchange([0, 1, 2, 3, 4, 5, 6, 7], 0, None, "ring_kv")
    ring = RingPlan.build(plan.tasks, RingRotation(wire, wire, 8), KERNEL, 0.25, 32)
    schedule = layout_schedule("contiguous", 8, 512, SlidingWindow(16, 0), 1, KERNEL.capabilities.masks)
    halo = RingPlan.build(schedule.tasks[0], HaloRotation(schedule, 0, range(8), None), KERNEL, 0.25, 64)
    for p in (ring, halo):
        assert "moves K/V between ranks inside the step" in graphs.refusal(p, CUDA)
    dropout = RingPlan.build(_plan("a2a").tasks, _plan("a2a").rotation, KERNEL, 0.25, 256, dropout_p=0.1)
    assert graphs.refusal(dropout, CUDA) == "attention dropout (0.1) draws a new mask per call; use dropout 0"


def test_static_buffers_and_clones_keep_packed_k_v_packed_in_storage_of_their_own():
    q = torch.randn(6, 1, 4, 3)
    kv = torch.randn(6, 1, 2, 5)
    k, v = split_kv(kv, 3)
    static = graphs._static_like(q, k, v, None)
    assert static[3] is None and packed_columns(static[1], static[2]) is not None
    assert [tuple(s.shape) for s in static[:3]] == [tuple(x.shape) for x in (q, k, v)]
    assert static[0].stride() == q.stride() and static[1].data_ptr() != k.data_ptr()
    clones = graphs._cloned(q, k, v, None)
    assert clones[3] is None and packed_columns(clones[1], clones[2]) is not None
    assert all(torch.equal(c, x) and c.data_ptr() != x.data_ptr() for c, x in zip(clones[:3], (q, k, v)))
    apart = graphs._static_like(q, k.clone(), v.clone())  # separate K and V stay separate
    assert packed_columns(apart[1], apart[2]) is None
    assert graphs._signature(q, k, v, None) != graphs._signature(q, k.clone(), v.clone(), None)


def test_a_replay_refuses_cpu_and_fake_cuda_tensors():
    plan = _plan("a2a")
    x = torch.zeros(256, 1, 1, 16)
    with pytest.raises(ValueError, match=r"step_graphs=True\) needs real CUDA tensors, got cpu tensors; build the "
                                         r"engine with step_graphs=False"):
        graphs.StepGraphs().forward(x, x, x, plan, None)
    with FakeTensorMode():
        fake = torch.zeros(256, 1, 1, 16, device="cuda")
        with pytest.raises(ValueError, match="needs real CUDA tensors, got fake cuda tensors"):
            graphs.StepGraphs().forward(fake, fake, fake, plan, None)


def _engine_errors(rank, world):
    from mcp_context import build_hcp_groups, context_parallel_attention
    from mcp_context.engine import ContextParallelAttention

    groups = build_hcp_groups([world])
    x = torch.zeros(8, 1, 4, 4)
    out = {}
    try:
        context_parallel_attention(x, x, x, groups, comm="a2a", step_graphs=True)
    except ValueError as err:
        out["cpu"] = str(err)
    try:
        context_parallel_attention(x, x, x, groups, comm="all_gather", step_graphs=True,
                                   cu_seqlens=torch.tensor([0, 8, 16], dtype=torch.int32))
    except ValueError as err:
        out["packed"] = str(err)
    try:
        ContextParallelAttention(groups, comm="a2a", step_graphs="yes")
    except TypeError as err:
        out["type"] = str(err)
    return out


def test_the_engine_refuses_graphs_it_cannot_replay_naming_the_switch():
    errors = run_distributed(2, _engine_errors)[0]
    assert errors["cpu"] == ("step_graphs=True with comm='a2a': CUDA graphs replay on a CUDA device, and the shards "
                             "are on cpu; or build the engine with step_graphs=False")
    assert re.search(r"step_graphs=True with comm='all_gather': a packed sequence's documents change from batch to "
                     r"batch, and each packing would capture new graphs; or build", errors["packed"])
    assert errors["type"].startswith("step_graphs='yes' must be a bool")


@pytest.mark.parametrize("comm, sink", [("a2a", False), ("all_gather", True), ("a2a+all_gather", False)])
def test_the_runners_own_ops_rehearse_on_fake_cuda_tensors(comm, sink):
    """The CUDA path's rehearsal (``tests/rehearsal.py``): the runner's buffers, copies in and clones out around
    the executor's forward and backward, on fake CUDA bf16 tensors with the kernel cuDNN would serve, K/V packed
    where the scheme moves them, the capture by ``rerun`` (CUDA's capture itself cannot run here). Each result
    comes back a CUDA tensor of its shape and dtype, not a view of the captured outputs, dK/dV the columns of
    one buffer where the eager step gives them so. The backward is driven directly: the autograd engine aborts on fake CUDA tensors."""
    with FakeTensorMode():
        kernel = get_kernel("auto", CUDA, torch.bfloat16, head_dim=128)
        step = rank_step(comm, 8, 32768, CAUSAL, kernel, 32, 8, 128)
        plan, kv_rows = step.plan, step.kv_rows
        runner = graphs.StepGraphs(rerun)

        def empty(*shape):
            return torch.empty(*shape, device=CUDA, dtype=torch.bfloat16)
        q, dout = empty(step.q_rows, 1, step.heads, 128), empty(step.q_rows, 1, step.heads, 128)
        k, v = kv_inputs(step, lambda dims: empty(kv_rows, 1, step.kv_heads, dims), 128)
        s = torch.empty(step.heads, device=CUDA) if sink else None
        for _ in range(2):
            out, lse = runner.forward(q, k, v, plan, s)
            grads = runner.backward(dout, q, k, v, out, lse, plan, s)
        assert runner.captures == 2
        assert (tuple(out.shape), out.dtype, out.device.type) == ((step.q_rows, 1, step.heads, 128), torch.bfloat16,
                                                                  "cuda")
        assert [tuple(g.shape) for g in grads[:3]] == [tuple(x.shape) for x in (q, k, v)]
        assert all(g.device.type == "cuda" for g in grads[:3]) and (grads[3] is not None) == sink
        captured = next(c for key, c in runner.graphs.items() if key[0] == "backward")
        assert not any(torch._C._is_alias_of(g, o) for g, o in zip(grads[:3], captured.outputs[:3]))
        eager = ring_backward(dout, q, k, v, out, lse, plan, s)  # packed dK/dV where the executor packs them
        assert (packed_columns(grads[1], grads[2]) is None) == (packed_columns(eager[1], eager[2]) is None)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graph capture)")


def _grads(plan, q, k, v, dout, sink):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)] + ([sink.detach().requires_grad_()] if sink is not None
                                                                 else [])
    out, lse = RingAttention.apply(*leaves[:3], plan, leaves[3] if sink is not None else None)
    out.backward(dout)
    return [out.detach(), lse] + [x.grad for x in leaves]


def rerun(run, static):
    """A capture for the CPU (``graphs.Capture``): a replay reruns the step on the static buffers and writes
    the first outputs' memory, as a graph's replay does."""
    outputs = tuple(run(*static))

    def replay():
        for o, new in zip(outputs, run(*static)):
            if o is not None:
                torch.ops.aten.copy_(o, new)  # not Tensor.copy_: fake CUDA tensors (executor._copy_)
    return replay, outputs


def failing_capture(run, static):
    """A capture that raises as a CUDA capture can (its message's second line is not part of the report)."""
    raise RuntimeError("operation not permitted when stream is capturing\nmore")


def _replays_match(comm: str, sink: bool, device: torch.device, dtype: torch.dtype, capture, tol: float) -> None:
    """Three calls of a rank's step of ``comm`` on fresh inputs (a ring's member over every member's K/V laid
    out locally, ``LocalRotation``: the walked ring's received buffers hold no data), each against the same
    step run eagerly: forward, lse and every gradient within ``tol`` relative to the
    largest value; one capture per direction; memory after the third call no more than after the second (on
    CUDA); the first call's results unchanged by the later replays."""
    import dataclasses

    kernel = get_kernel("auto", device, dtype, head_dim=64)
    step = rank_step(comm, 8, 4096 if device.type == "cuda" else 256, CAUSAL, kernel, 8, 2, 64)
    plan, kv_rows = step.plan, step.kv_rows
    runner = graphs.StepGraphs(capture)
    graphed = dataclasses.replace(plan, runner=runner)
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    kept = held = None
    for call in range(3):
        q = rand(step.q_rows, 1, step.heads, 64)
        k, v = kv_inputs(step, lambda dims: rand(kv_rows, 1, step.kv_heads, dims), 64)
        dout, s = rand(*q.shape), (rand(step.heads).float() if sink else None)
        eager, replayed = _grads(plan, q, k, v, dout, s), _grads(graphed, q, k, v, dout, s)
        for e, r in zip(eager, replayed):
            assert e.shape == r.shape and e.dtype == r.dtype
            assert (e.float() - r.float()).abs().max() <= tol * (1 + e.float().abs().max()), (comm, call)
        if call == 0:
            kept = [x.clone() for x in replayed], replayed
        if call == 1 and device.type == "cuda":
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
    if held is not None:
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= held + 2 ** 20
    assert runner.captures == 2  # one forward and one backward capture for this signature
    assert all(torch.equal(a, b) for a, b in zip(*kept))  # later replays did not write into an earlier result


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("comm", SCHEMES)
def test_a_replayed_step_copies_in_clones_out_and_captures_once(comm, sink):
    """CPU, fp32, with ``rerun`` for the capture: the runner's bookkeeping gives exactly the eager step's
    results (the same ops on the same numbers)."""
    _replays_match(comm, sink, CPU, torch.float32, rerun, 0.0)


@needs_cuda
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("comm", SCHEMES)
def test_on_cuda_a_replayed_step_gives_the_eager_steps_results(comm, sink):
    """bf16, CUDA graphs: the same kernels in the same order, so equal within bf16 rounding of differently
    scheduled sums (2e-2 relative to the largest value)."""
    _replays_match(comm, sink, CUDA, torch.bfloat16, None, 2e-2)


def _engine_parity(rank, world):
    from mcp_context import build_hcp_groups, context_parallel_attention

    groups = build_hcp_groups([world])
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(512, 1, h, 64, generator=g, device="cuda").to(torch.bfloat16) for h in (8, 2, 2))
    results = []
    for graphed in (False, True, True):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = context_parallel_attention(*leaves, groups, comm="a2a", step_graphs=graphed)
        out.float().square().sum().backward()
        results.append([out.detach()] + [x.grad for x in leaves])
    return max(float((a.float() - b.float()).abs().max() / (1 + a.float().abs().max()))
               for other in results[1:] for a, b in zip(results[0], other))


@needs_cuda
def test_on_cuda_the_engine_with_step_graphs_gives_the_eager_engines_results():
    """One CP rank (nothing crosses a process), comm a2a: the engine's scheme replays its step from graphs."""
    assert run_distributed(1, _engine_parity)[0] <= 2e-2


def _megatron_layer(rank, world):
    import megatron_patches
    from megatron.core import parallel_state

    from mcp_context.megatron.specs import get_gpt_layer_hcp_spec
    from tests.tiny_gpt import batch, init_parallel, tiny_config, tiny_gpt

    megatron_patches.apply_all(device="cpu")
    init_parallel(context_parallel_size=world)
    try:
        config = tiny_config(context_parallel_size=world, cp_comm_type="a2a")
        model = tiny_gpt(config, get_gpt_layer_hcp_spec(step_graphs=True))
        attention = [m for m in model.modules() if type(m).__name__ == "HCPDotProductAttention"]
        tokens, positions, labels = batch()
        n = tokens.shape[1] // world
        try:
            model(tokens[:, :n], positions[:, :n], None, labels=labels[:, :n])
            return len(attention), None
        except ValueError as err:
            return len(attention), str(err)
    finally:
        parallel_state.destroy_model_parallel()


def test_the_megatron_specs_step_graphs_reach_the_engine():
    """``get_gpt_layer_hcp_spec(step_graphs=True)``: every layer's core attention builds its engine with it, and
    on the CPU the first call refuses it, naming the switch (a CUDA run replays; not yet run on a GPU)."""
    layers, error = run_distributed(2, _megatron_layer)[0]
    assert layers >= 1 and error == ("step_graphs=True with comm='a2a': CUDA graphs replay on a CUDA device, and "
                                     "the shards are on cpu; or build the engine with step_graphs=False")
