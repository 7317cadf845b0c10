"""Calls planned for the GPU's SMs (``algorithms/calls.py``): where a call cannot fill the GPU, equal tasks of a
step run stacked in one call and a lone full block's forward runs with its keys split, with the results of one
call per task.

The plan is the one an all-gather's rank runs (K/V local, ``gathered_tasks``: rank 0 of 4 over 256 tokens, zigzag:
a causal square for chunk 0; chunk 7 against chunks 0-6 as one full block, and its own causal square), on CPU with
a GPU of 16 or 8 SMs and 16-row tiles assumed (``assumed_gpu``), so 2-4 heads of 32-row chunks are short of
blocks as 4 heads of 2048 rows are on an H200. Out, lse, dq, dk and dv against the fp64 full-attention reference
(fp64 1e-10, fp32 1e-5), with the calls counted; bf16 against the same plan run one call per task. The same calls
on fake CUDA tensors through cuDNN's op at Llama-3-8B's 32K/P64 shape (the rehearsal), and under the side-stream
race checker.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mcp_context.algorithms.calls import Call, Gpu, assumed_gpu, calls_for, pass_gpu, step_calls
from mcp_context.algorithms.executor import RingAttention, RingPlan, ring_backward, ring_forward
from mcp_context.algorithms.rotation import LocalRotation
from mcp_context.algorithms.schemes import gathered_tasks
from mcp_context.kernels import get_kernel
from mcp_context.kernels.math import MathKernel
from mcp_context.kernels.torch_sdpa import cpu_flash_kernel
from mcp_context.layouts import shard_positions
from mcp_context.masks import CAUSAL, CAUSAL_BLOCK, FULL_BLOCK
from mcp_context.schedule import BlockTask, layout_schedule
from tests.reference import TOL, full_attention, random_qkv

S, CP, D = 256, 4, 16


@pytest.fixture(autouse=True)
def _sized_calls_on(monkeypatch):
    """These calls are opt-in (``MCP_CONTEXT_SIZED_CALLS=1``: the module note of ``algorithms/calls.py``)."""
    monkeypatch.setenv("MCP_CONTEXT_SIZED_CALLS", "1")
TASKS = (BlockTask((0, 32), (0, 32), CAUSAL_BLOCK), BlockTask((32, 64), (0, 224), FULL_BLOCK),
         BlockTask((32, 64), (224, 256), CAUSAL_BLOCK))


def test_the_gathered_plan_is_the_one_these_tests_run():
    schedule = layout_schedule("zigzag", CP, S, CAUSAL, 1, cpu_flash_kernel().capabilities.masks)
    assert tuple(gathered_tasks(schedule, 0, cpu_flash_kernel().capabilities.masks)[0]) == TASKS


@pytest.mark.parametrize("gpu,parts", [(Gpu(16, 16), 4), (Gpu(8, 16), 2)])
def test_short_equal_tasks_are_stacked_and_a_short_full_block_split_by_keys(gpu, parts):
    # 2 heads: the squares give 4 blocks either way, the full block 4 forward (its 224 keys: 28 backward)
    assert step_calls(TASKS, 2, gpu, True) == (Call((0, 2)), Call((1,), parts))
    assert step_calls(TASKS, 2, gpu, False) == (Call((0, 2)), Call((1,)))


def test_calls_that_fill_the_gpu_stay_one_per_task():
    assert step_calls(TASKS, 64, Gpu(16, 16), True) == step_calls(TASKS, 64, Gpu(16, 16), False) == (
        Call((0,)), Call((1,)), Call((2,)))
    x = torch.empty(0)
    # a CPU: no GPU to fill
    assert calls_for(TASKS, 2, pass_gpu(x, False), True) == (Call((0,)), Call((1,)), Call((2,)))
    with assumed_gpu(Gpu(16, 16)):
        # dropout: each its own
        assert calls_for(TASKS, 2, pass_gpu(x, True), True) == (Call((0,)), Call((1,)), Call((2,)))


def test_equal_tasks_are_stacked_only_as_many_as_fill_the_gpu_once():
    """Five causal squares that each keep half of the SMs busy (4 heads x loads 1 and 2 of 2 tiles on 12 SMs):
    two to a call, not all five (their rows would all be copied and held at once for no more occupancy)."""
    squares = tuple(BlockTask((32 * i, 32 * i + 32), (64 * i, 64 * i + 32), CAUSAL_BLOCK) for i in range(5))
    assert step_calls(squares, 4, Gpu(12, 16), True) == (Call((0, 1)), Call((2, 3)), Call((4,)))
    assert step_calls(squares, 4, Gpu(24, 16), True) == (Call((0, 1, 2, 3)), Call((4,)))


def test_the_sized_calls_switch_is_read_and_checked(monkeypatch):
    x = torch.empty(0)
    with assumed_gpu(Gpu(16, 16)):
        monkeypatch.delenv("MCP_CONTEXT_SIZED_CALLS")  # unset: one call per task until a GPU has run them exact
        assert calls_for(TASKS, 2, pass_gpu(x, False), True) == (Call((0,)), Call((1,)), Call((2,)))
        monkeypatch.setenv("MCP_CONTEXT_SIZED_CALLS", "0")
        assert calls_for(TASKS, 2, pass_gpu(x, False), True) == (Call((0,)), Call((1,)), Call((2,)))
        monkeypatch.setenv("MCP_CONTEXT_SIZED_CALLS", "1")
        assert calls_for(TASKS, 2, pass_gpu(x, False), True) == (Call((0, 2)), Call((1,), 4))
        monkeypatch.setenv("MCP_CONTEXT_SIZED_CALLS", "yes")
        with pytest.raises(ValueError, match=r"MCP_CONTEXT_SIZED_CALLS='yes' must be 0 .* or 1 .*; unset it for "
                           r"the default, 0 \(one attention call per block task\)"):
            calls_for(TASKS, 2, pass_gpu(x, False), True)


def test_key_parts_cut_the_keys_evenly_and_no_shorter_than_a_tile():
    full = BlockTask((0, 32), (0, 96), FULL_BLOCK)  # 96 keys: 6 tiles of 16
    assert step_calls((full,), 1, Gpu(132, 16), True) == (Call((0,), 6),)  # 2 blocks want 66 parts; 6 tiles
    assert step_calls((BlockTask((0, 32), (0, 112), FULL_BLOCK),), 1, Gpu(8, 16), True) == (Call((0,), 4),)
    assert step_calls((BlockTask((0, 32), (0, 100), FULL_BLOCK),), 1, Gpu(8, 16), True) == (Call((0,), 4),)
    assert step_calls((BlockTask((0, 32), (0, 102), FULL_BLOCK),), 1, Gpu(8, 16), True) == (Call((0,), 3),)


def _order(x: torch.Tensor) -> tuple[int, ...]:
    """The dimensions of ``x`` of more than one entry, outermost in memory first: its layout."""
    return tuple(sorted((d for d in range(x.dim()) if x.shape[d] > 1), key=lambda d: -x.stride(d)))


class _Counted:
    """A kernel, how many calls it was given each way, and the layouts of each call's row operands (forward:
    q, k, v; backward: dout, q, k, v, out)."""

    def __init__(self, kernel):
        self.kernel, self.name, self.capabilities = kernel, kernel.name, kernel.capabilities
        self.forwards = self.backwards = 0
        self.layouts: list[tuple[tuple[int, ...], ...]] = []

    def forward(self, q, k, v, *args, **kwargs):
        self.forwards += 1
        self.layouts.append(tuple(map(_order, (q, k, v))))
        return self.kernel.forward(q, k, v, *args, **kwargs)

    def backward(self, dout, q, k, v, out, *args, **kwargs):
        self.backwards += 1
        self.layouts.append(tuple(map(_order, (dout, q, k, v, out))))
        return self.kernel.backward(dout, q, k, v, out, *args, **kwargs)


def _run(kernel, dtype, gpu, batch=1):
    q, k, v, dout = random_qkv(S, batch, 4, 2, D, 0)
    rows = shard_positions(S, CP, 0, "zigzag")
    local = [x.detach().to(dtype).clone().requires_grad_() for x in (q[rows], k, v)]
    plan = RingPlan.build([list(TASKS)], LocalRotation(0, 1), kernel, D ** -0.5, len(rows))
    with assumed_gpu(gpu):
        out, lse = RingAttention.apply(*local, plan)
        out.backward(dout[rows].to(dtype))
    return (out.detach(), lse.permute(2, 0, 1), *(x.grad for x in local)), (q, k, v, dout, rows)


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("gpu,batch,parts", [(Gpu(32, 16), 1, 4), (Gpu(16, 16), 1, 2), (Gpu(32, 16), 2, 2)],
                         ids=["4-key-parts", "2-key-parts", "batch-2"])
def test_stacked_and_split_calls_match_the_fp64_reference(kernel, dtype, gpu, batch, parts):
    counted = _Counted(cpu_flash_kernel() if kernel == "cpu_flash" else MathKernel())
    got, (q, k, v, dout, rows) = _run(counted, dtype, gpu, batch)
    assert step_calls(TASKS, 4 * batch, gpu, True) == (Call((0, 2)), Call((1,), parts))  # 4 query heads
    assert (counted.forwards, counted.backwards) == (2, 2)  # the squares stacked, the full block one call
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = full_attention(*ref, True, D ** -0.5)
    (ref_out[rows] * dout[rows]).sum().backward()
    want = (ref_out[rows].detach(), ref_lse[rows], ref[0].grad[rows], ref[1].grad, ref[2].grad)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        err = (a.double() - b).abs().max().item()
        assert err <= TOL[dtype], (name, err)


@pytest.mark.parametrize("gpu,batch", [(Gpu(32, 16), 1), (Gpu(32, 16), 2)], ids=["one-sequence", "batch-2"])
def test_every_operand_of_a_stacked_or_split_call_is_laid_out_token_major(gpu, batch):
    """A call's row operands share one layout with the rows outside the heads: ``[b, h, n, d]`` laid out
    ``b, n, h, d`` for a stack (``n, h, d`` for one sequence's single call, ``n, b, h, d`` for a batch's: the
    executor's sbhd storage). On an H200, cuDNN gave a split call whose query stack was copied head-major
    (``b, h, n, d``) beside token-major key views 8 % wrong results."""
    counted = _Counted(cpu_flash_kernel())
    _run(counted, torch.float32, gpu, batch)
    assert counted.layouts and all(len(set(call)) == 1 for call in counted.layouts), counted.layouts
    stacks = [call[0] for call in counted.layouts if call[0] not in {(2, 1, 3), (2, 0, 1, 3)}]
    assert stacks and set(stacks) == {(0, 2, 1, 3)}, counted.layouts


def test_in_bf16_the_stacked_and_split_calls_give_what_one_call_per_task_gives():
    got, _ = _run(cpu_flash_kernel(), torch.bfloat16, Gpu(16, 16))
    want, _ = _run(cpu_flash_kernel(), torch.bfloat16, None)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        # the stacked squares are the same op on the same rows; the split block's out has one more rounding
        # (its key parts merged in fp32 and rounded once), which reaches dq, dk and dv through out; its lse is
        # the parts' merged in fp32 (the op sums its rows in another order)
        bound = 1e-4 if name == "lse" else 2 ** -6
        assert (a.double() - b.double()).abs().max().item() <= bound, name


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_calls_rehearse_on_fake_cuda_through_cudnn_at_llama3_8b_32k_over_64_ranks():
    """An a2a+all_gather [8, 8] rank: 4 query heads, 1 KV head, 4096 query rows against 32K gathered keys, on an
    H200's 132 SMs: the two 2048-row squares stacked (64 + 64 blocks), the full block's forward in two key
    parts (128 blocks), and every output of the right shape, dtype and device."""
    with FakeTensorMode():
        cuda = torch.device("cuda")
        kernel = get_kernel("torch:cudnn", cuda, torch.bfloat16, head_dim=128)
        schedule = layout_schedule("zigzag", 8, 32768, CAUSAL, 1, kernel.capabilities.masks)
        tasks = gathered_tasks(schedule, 0, kernel.capabilities.masks)
        q, dout = (torch.empty(4096, 1, 4, 128, device=cuda, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.empty(32768, 1, 1, 128, device=cuda, dtype=torch.bfloat16) for _ in range(2))
        plan = RingPlan.build(tasks, LocalRotation(0, 1), kernel, 128 ** -0.5, 4096)
        with assumed_gpu(Gpu(132)):
            assert calls_for(tasks[0], 4, pass_gpu(q, False), True) == (Call((0, 2)), Call((1,), 2))
            assert calls_for(tasks[0], 4, pass_gpu(q, False), False) == (Call((0, 2)), Call((1,)))
            out, lse = ring_forward(q, k, v, plan)
            dq, dk, dv, _ = ring_backward(dout, q, k, v, out, lse, plan)
        for x, like in ((out, q), (dq, q), (dk, k), (dv, v)):
            assert (x.shape, x.dtype, x.device.type) == (like.shape, torch.bfloat16, "cuda")
        assert (lse.shape, lse.dtype) == ((1, 4, 4096), torch.float32)


@pytest.mark.parametrize("comm,rank", [("all_gather", 0), ("all_gather", 5), ("a2a+all_gather", 1)])
def test_the_stacked_and_split_calls_keep_the_side_streams_rules(monkeypatch, comm, rank):
    """The side stream's protocol checked op by op (``tests/stream_races.py``) with the calls planned for a GPU
    of 64 SMs: their outputs are views of one call's output, read after the call on the side stream."""
    from tests.stream_races import races_of
    from tests.test_streams import _member, _read, _step

    build, inputs = _member(comm, rank, torch.bfloat16, cpu_flash_kernel())
    run = _step(build, inputs, False, monkeypatch)
    with assumed_gpu(Gpu(64, 16)):
        races, scopes = races_of(run, read_after=_read)
    assert scopes > 0 and races == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the SM count decides the calls)")
def test_on_cuda_the_sized_calls_give_what_one_call_per_task_gives():
    """The a2a+all_gather [8, 8] rank of Llama-3-8B at 32K (4 query heads, 1 KV head, 4096 query rows against 32K
    keys, bf16) through cuDNN: with the device's SMs (its squares stacked and, on 128 SMs or more, its full
    block's forward in 2 key runs) against one call per task (a GPU of one SM assumed: every call fills it).
    Out within 2 bf16 units of its magnitude (one more rounding for the split block), lse within 1e-3,
    gradients within 2e-2 (cuDNN's backward sums dQ in no fixed order, test_streams' bound)."""
    cuda = torch.device("cuda")
    kernel = get_kernel("torch:cudnn", cuda, torch.bfloat16, head_dim=128)
    schedule = layout_schedule("zigzag", 8, 32768, CAUSAL, 1, kernel.capabilities.masks)
    tasks = gathered_tasks(schedule, 0, kernel.capabilities.masks)
    g = torch.Generator(device=cuda).manual_seed(0)
    q, dout = (torch.randn(4096, 1, 4, 128, device=cuda, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(32768, 1, 1, 128, device=cuda, generator=g).to(torch.bfloat16) for _ in range(2))
    plan = RingPlan.build(tasks, LocalRotation(0, 1), kernel, 128 ** -0.5, 4096)
    sms = torch.cuda.get_device_properties(cuda).multi_processor_count
    # 64 blocks each: short on any datacenter GPU
    assert calls_for(tasks[0], 4, pass_gpu(q, False), True)[0] == Call((0, 2))
    if sms >= 128:
        assert calls_for(tasks[0], 4, pass_gpu(q, False), True)[1] == Call((1,), 2)
    results = []
    for gpu in (None, Gpu(1)):
        with assumed_gpu(gpu):
            out, lse = ring_forward(q, k, v, plan)
            results.append((out, lse, *ring_backward(dout, q, k, v, out, lse, plan)[:3]))
    (out, lse, dq, dk, dv), (out1, lse1, dq1, dk1, dv1) = results
    assert (out.float() - out1.float()).abs().max().item() <= 2 * 2 ** -8 * out1.float().abs().max().item()
    assert (lse - lse1).abs().max().item() <= 1e-3
    for a, b in ((dq, dq1), (dk, dk1), (dv, dv1)):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * max(1.0, b.float().abs().max().item())
