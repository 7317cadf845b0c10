"""Compiled regions called directly (``mcp_context/regions.py``), here compiled for the CPU (Inductor's C++):
a layout that went through dynamo once is called directly after, with the kernel dynamo's guards picked for
it, bit for bit what the call through dynamo gives; anything that would change what the guards read is a
new layout; where Inductor's own input checks or an unknown graph input refuse a direct call, the call goes
through dynamo. The CUDA case (Triton) is ``tests/test_gpu.py``'s ring step, which runs the shipped regions."""
import os
import shutil

import pytest
import torch

from mcp_context import merge, regions
from mcp_context.merge import merge_blocks_eager_

NEG_INF = float("-inf")
NO_CXX = None if shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++") else \
    "needs a C++ compiler (Inductor compiles the regions for the CPU in C++)"


def _token_major(rows: int, heads: int = 3, dim: int = 8, gen=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's ``out [1, h, rows, d]`` (a view of token-major storage, as the executor's) and ``lse [1, h, rows]``,
    with a few rows that saw no key."""
    out = torch.randn(rows, 1, heads, dim, generator=gen).permute(1, 2, 0, 3)
    lse = torch.randn(1, heads, rows, generator=gen)
    lse[0, 0, :2] = NEG_INF
    out[0, 0, :2] = 0
    return out, lse


def _operands(rows: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [*_token_major(rows, gen=gen), *_token_major(rows, gen=gen), *_token_major(rows, gen=gen)]


def _copies(args: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same values in the same layout, in fresh storage."""
    return [torch.empty_strided(a.shape, a.stride()).copy_(a) for a in args]


@pytest.fixture
def region(monkeypatch):
    """A merge region that compiles on the CPU, its calls through dynamo counted."""
    if NO_CXX:
        pytest.skip(NO_CXX)
    r = regions.Region(merge_blocks_eager_, "test merge")
    r.devices = ("cuda", "cpu")
    r.through = 0
    run_compiled = r.run_compiled

    def counted(*args):
        r.through += 1
        run_compiled(*args)
    monkeypatch.setattr(r, "run_compiled", counted)
    monkeypatch.delenv(regions.DIRECT_ENV, raising=False)
    yield r
    torch._dynamo.reset()


def test_a_layout_seen_through_dynamo_is_then_called_directly_with_the_same_kernel(region):
    first = _operands(16)
    again, eager = _copies(first), _copies(first)
    region(*first)
    assert region.through == 1 and list(region.direct.values()) != [None]
    region(*again)
    assert region.through == 1, "the same layout went through dynamo again"
    for direct, through in zip(again[:2], first[:2]):
        assert torch.equal(direct, through)
    merge_blocks_eager_(*eager)
    assert torch.allclose(again[0], eager[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(again[1].isinf(), eager[1].isinf()) and (again[1][0, 0, :2] == NEG_INF).all()
    finite = eager[1].isfinite()
    assert torch.allclose(again[1][finite], eager[1][finite], atol=1e-6, rtol=1e-6)


def test_a_merge_of_many_blocks_reads_each_from_its_place_among_the_operands(region):
    """A merge of four held blocks into the first one's rows (``merge_blocks_``'s ``*blocks``: dynamo names
    them as items of that parameter), through dynamo, then directly: bit for bit alike, and as the eager merge
    within 1e-6."""
    def run():
        gen = torch.Generator().manual_seed(5)
        blocks = [x for _ in range(4) for x in _token_major(16, gen=gen)]
        eager = [x.clone() for x in blocks]
        merge_blocks_eager_(eager[0], eager[1], *eager)
        region(blocks[0], blocks[1], *blocks)
        return blocks, eager
    (through, _), (direct, eager) = run(), run()
    assert region.through == 1 and None not in region.direct.values()
    assert torch.equal(direct[0], through[0]) and torch.equal(direct[1], through[1])
    assert torch.allclose(direct[0], eager[0], atol=1e-6, rtol=1e-6)


def test_another_length_is_a_new_layout_then_direct_too(region):
    region(*_operands(16))
    longer = _operands(40, seed=1)
    through, direct = _copies(longer), _copies(longer)
    region(*through)
    region(*direct)
    assert region.through == 2 and len(region.direct) == 2 and None not in region.direct.values()
    assert torch.equal(direct[0], through[0]) and torch.equal(direct[1], through[1])


@pytest.mark.parametrize("aliasing", ["in place", "same rows, another view"])
def test_aliased_operands_are_called_directly_as_dynamo_calls_them(region, aliasing):
    """The accumulator merged in place (``merge_``: out is a_out), and a held block's rows written over by the
    merged result (``out`` and ``a_out`` two views of the same rows), each called twice: through dynamo, then
    directly, bit for bit alike and as the eager merge."""
    def run(seed):
        acc, acc_lse, block, block_lse = *_token_major(24, gen=torch.Generator().manual_seed(seed)), \
            *_token_major(24, gen=torch.Generator().manual_seed(seed + 1))
        eager = [acc.clone(), acc_lse.clone()]
        merge_blocks_eager_(eager[0], eager[1], eager[0].clone(), eager[1].clone(), block, block_lse)
        if aliasing == "in place":
            region(acc, acc_lse, acc, acc_lse, block, block_lse)
        else:
            region(acc.narrow(2, 0, 24), acc_lse, acc.narrow(2, 0, 24), acc_lse.narrow(2, 0, 24), block, block_lse)
        return acc, acc_lse, eager
    through, direct = run(0), run(0)
    assert region.through == 1
    assert torch.equal(direct[0], through[0]) and torch.equal(direct[1], through[1])
    assert torch.allclose(direct[0], direct[2][0], atol=1e-6, rtol=1e-6)


def _changed(args: list[torch.Tensor], what: str) -> list[torch.Tensor]:
    changed = list(args)
    if what == "dtype":
        changed[4] = args[4].double()
    elif what == "strides":
        changed[0] = args[0].contiguous()
    elif what == "sizes":
        changed = _operands(17)
    elif what == "storage offset":
        changed[5] = torch.cat([torch.zeros(1, 3, 1), args[5]], 2).narrow(2, 1, args[5].shape[2])
    elif what == "requires grad":
        changed[4] = args[4].detach().requires_grad_()
    elif what == "same tensor":
        changed[2], changed[3] = args[0], args[1]
    elif what == "shared storage":
        changed[2] = args[0].view(args[0].shape)  # another tensor over the same bytes
    return changed


@pytest.mark.parametrize("what", ["dtype", "strides", "sizes", "storage offset", "requires grad", "same tensor",
                                  "shared storage"])
def test_the_layout_key_tells_apart_what_dynamos_guards_read(what):
    args = _operands(16)
    assert regions.layout_key(args) == regions.layout_key(_copies(args))  # the values do not matter
    assert regions.layout_key(_changed(args, what)) != regions.layout_key(args)


def test_grad_mode_is_a_new_layout():
    args = _operands(16)
    on = regions.layout_key(args)
    with torch.no_grad():
        assert regions.layout_key(args) != on


def test_a_direct_call_inductors_checks_refuse_leaves_the_operands_and_goes_through_dynamo(region):
    """A direct call made for one layout, handed operands of another (a key that missed something): Inductor's
    size and stride checks refuse it before writing, the call goes through dynamo, and that layout does from
    then on."""
    region(*_operands(16))
    (wrong,) = region.direct.values()
    other = _operands(16, seed=2)
    other[0] = other[0].contiguous()  # strides the kernel was not compiled for
    before = [a.clone() for a in other]
    assert wrong(other) is False
    assert all(torch.equal(a, b) for a, b in zip(other, before))
    key = regions.layout_key(other)
    region.direct[key] = wrong
    eager = _copies(other)
    region(*other)
    merge_blocks_eager_(*eager)
    assert region.through == 2 and region.direct[key] is None
    assert torch.allclose(other[0], eager[0], atol=1e-6, rtol=1e-6)


def test_a_graph_input_read_in_an_unknown_way_keeps_its_layout_with_dynamo():
    args = _operands(8)
    assert regions._Variant(lambda *a: None, None, ["out"]).bound(args) is None  # this torch kept no sources
    assert regions._Variant(lambda *a: None, [object()], ["out"]).bound(args) is None


def test_the_switch_sends_every_call_through_dynamo_and_refuses_other_values(region, monkeypatch):
    monkeypatch.setenv(regions.DIRECT_ENV, "0")
    args = _operands(16)
    region(*args)
    region(*_copies(args))
    assert region.through == 2 and not region.direct
    monkeypatch.delenv(regions.DIRECT_ENV)
    with regions.through_dynamo():
        region(*_copies(args))
    assert region.through == 3 and not region.direct
    monkeypatch.setenv(regions.DIRECT_ENV, "yes")
    with pytest.raises(ValueError, match=r"MCP_CONTEXT_DIRECT_REGIONS='yes' must be 0 .* or 1"):
        region(*_copies(args))


def test_past_the_layouts_kept_new_layouts_go_through_dynamo(region, monkeypatch):
    monkeypatch.setattr(regions, "LAYOUTS_KEPT", 1)
    region(*_operands(16))
    longer = _operands(40, seed=1)
    eager = _copies(longer)
    region(*longer)
    region(*_copies(longer))
    merge_blocks_eager_(*eager)
    assert region.through == 3 and len(region.direct) == 1
    assert torch.allclose(longer[0], eager[0], atol=1e-6, rtol=1e-6)


def test_under_a_dispatch_mode_calls_go_through_dynamo(region):
    """A mode (a counter, a race checker) sees the ops of a call through dynamo, not a direct call's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    args = _operands(16)
    region(*args)
    assert regions.direct_calls_enabled()
    with Seen():
        assert not regions.direct_calls_enabled()


def _shipped_regions_counted(monkeypatch, on_cpu: bool) -> list:
    """The shipped regions with no layout remembered, compiling for the CPU too where ``on_cpu``, direct calls
    on: the list each call through dynamo appends to."""
    monkeypatch.delenv(regions.DIRECT_ENV, raising=False)
    through: list = []
    for r in merge.FUSED_REGIONS.values():
        if on_cpu:
            monkeypatch.setattr(r, "devices", ("cuda", "cpu"))
        monkeypatch.setattr(r, "direct", {})
        run_compiled = r.run_compiled
        monkeypatch.setattr(r, "run_compiled", lambda *a, run=run_compiled: (through.append(1), run(*a)))
    return through


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the shipped regions compile for CUDA with Triton)"))])
def test_a_ring_step_with_compiled_regions_runs_them_directly_from_its_second_step(monkeypatch, device):
    """One p2p member's forward and backward (rank 1 of 4, zigzag, causal, the other members' K/V laid out
    locally: merges, dQ sums, dK/dV first writes and adds) with every region compiled (for the CPU: Inductor's
    C++; on CUDA the shipped regions, bf16 with the fused op): every layout is readable for a direct call
    (this torch keeps dynamo's graph sources), the second step makes no call through dynamo, its forward is
    bit for bit the first's (cuDNN sums dQ in no fixed order: the gradients within bf16 rounding there), and
    both are the eager regions' within fp32 (CPU) or bf16 (CUDA) rounding."""
    from mcp_context.algorithms.executor import RingAttention
    from mcp_context.kernels import get_kernel
    from mcp_context.masks import CAUSAL
    from tools.rank_step import rank_step

    cuda = device == "cuda"
    if not cuda and NO_CXX:
        pytest.skip(NO_CXX)
    dtype, heads, kv_heads, dim, seq = (torch.bfloat16, 8, 2, 64, 1024) if cuda else (torch.float32, 4, 2, 8, 64)
    tol = dict(atol=2e-2, rtol=2e-2) if cuda else dict(atol=1e-5, rtol=1e-5)
    through = _shipped_regions_counted(monkeypatch, on_cpu=not cuda)
    kernel = get_kernel("auto", torch.device(device), dtype)
    step = rank_step("p2p", 4, seq, CAUSAL, kernel, heads, kv_heads, dim, rank=1)
    plan, kv_rows = step.plan, step.kv_rows  # every member's K/V laid out here (a walked ring moves no data)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(n, 1, h, dim, generator=gen).to(device, dtype) for n, h in
                     ((step.q_rows, heads), (kv_rows, kv_heads), (kv_rows, kv_heads), (step.q_rows, heads)))

    def run():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = RingAttention.apply(*leaves, plan)
        out.backward(dout)
        return [out.detach(), lse, *(x.grad for x in leaves)]
    try:
        first = run()
        assert through, "no region compiled"
        calls = len(through)
        second = run()
        assert all(d is not None for r in merge.FUSED_REGIONS.values() for d in r.direct.values()), \
            "a layout's graph inputs could not be read: its calls stay with dynamo"
        assert len(through) == calls, "the second step went through dynamo"
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
        for a, b in zip(first[2:], second[2:]):
            assert torch.equal(a, b) if not cuda else torch.allclose(a.float(), b.float(), **tol)
        for r in merge.FUSED_REGIONS.values():
            monkeypatch.setattr(r, "compiling", False)
        for got, want in zip(second, run()):
            assert torch.allclose(got.float(), want.float(), **tol)
    finally:
        torch._dynamo.reset()


def test_the_region_timings_a_gpu_runs_are_rehearsed_on_cpu(tmp_path):
    """``tools/kernel_rates.py --parts regions`` on CPU tensors with CUDA's events, sleep and synchronise answered
    on the host: a row per case and variant with the fields the next GPU run reads, the bytes by
    ``tools/step_ops``'s rule (an in-place merge reads and writes its sum)."""
    from tests.test_bench_device import cuda_timing_on_host
    from tools.kernel_rates import time_regions

    rows = []
    with cuda_timing_on_host():
        time_regions(rows.append, 4, 2, 8, 1, rows=32, shard=64, device=torch.device("cpu"), host_ahead=True)
    assert len(rows) == 7 * 5 and {r["variant"] for r in rows} == {"shipped", "through_dynamo", "per_shape",
                                                                    "every_size_symbolic", "eager"}
    assert all(r["gpu_us"] > 0 and r["host_us"] > 0 and r["gb_per_s"] > 0 and "host_ahead" in r for r in rows)
    acc, lse, half = 32 * 4 * 8 * 4, 32 * 4 * 4, 32 * 4 * 8 * 2
    merge = next(r for r in rows if r["case"] == "merge of five blocks into the sum")
    assert merge["bytes"] == acc + lse + 5 * (half + lse)  # each block read once, the sum and its lse written
    in_place = next(r for r in rows if r["case"] == "dQ sum: the sum and two blocks")
    assert in_place["bytes"] == 2 * acc + 2 * half  # the sum read and written

    import json

    from tools.gpu_report import report
    (tmp_path / "regions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report(str(tmp_path))
    assert "## The merges' and sums' kernels" in text and text.count("| dK/dV add | ") == 5, text


def test_every_role_through_direct_calls_gives_exact_attention(monkeypatch):
    """``tests/test_results.py``'s plan whose calls meet every role (rows met by 2, 3 and 4 blocks, held rows
    read across steps, rows one call writes, rows nobody writes; dK/dV first writes and adds) with every
    region compiled for the CPU, in bf16 as on a GPU (results rounded once from fp32 sums), run twice: the
    second run makes no call through dynamo and is bit for bit the first, and both are masked attention in
    fp64 within 2e-2 x max(1, |ref|), forward and gradients. (fp32: the ring step test above.)"""
    dtype, tol = torch.bfloat16, 2e-2
    if NO_CXX:
        pytest.skip(NO_CXX)
    from mcp_context.algorithms.executor import RingAttention, RingPlan
    from mcp_context.algorithms.rotation import LocalRotation
    from mcp_context.kernels.torch_sdpa import cpu_flash_kernel
    from tests.reference import relative_error
    from tests.test_results import ROWS, TASKS, _reference

    through = _shipped_regions_counted(monkeypatch, on_cpu=True)
    g = torch.Generator().manual_seed(0)
    q0 = torch.randn(ROWS, 1, 4, 16, generator=g).to(dtype)
    k0, v0 = (torch.randn(ROWS, 1, 2, 16, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(ROWS, 1, 4, 16, generator=g).to(dtype)
    plan = RingPlan.build(TASKS, LocalRotation(0, 2), cpu_flash_kernel(), 16 ** -0.5, ROWS)

    def run():
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out, lse = RingAttention.apply(q, k, v, plan)
        out.backward(dout)
        return [out.detach(), lse, q.grad, k.grad, v.grad]
    try:
        first = run()
        calls = len(through)
        second = run()
        assert calls and len(through) == calls, "the second run went through dynamo"
        assert all(d is not None for r in merge.FUSED_REGIONS.values() for d in r.direct.values())
        for a, b in zip(first, second):
            assert torch.equal(a, b)
    finally:
        torch._dynamo.reset()
    ref = _reference(q0, k0, v0, dout)
    finite = ref[1].isfinite()
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), second, ref):
        if name == "lse":
            got, want = got[finite], want[finite]
        assert relative_error(got, want) <= tol, name


def test_the_engine_loads_without_dynamo():
    """Dynamo loads with the first compiled region call (``Region.run_compiled``), not with the engine's modules:
    a process that never compiles (a CPU run; each rank of the README's ``use.py`` under torchrun) does not pay
    for it (about 3 s of this project's 2-core CPU a process)."""
    import subprocess
    import sys

    probe = "import sys, mcp_context.engine, mcp_context.api; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", (done.stdout, done.stderr[-2000:])
