"""The CUDA path rehearsed on the CPU under ``FakeTensorMode`` (``tests/rehearsal.py``): shapes, dtypes,
devices and op schemas, never numbers.

Every ring member's forward and backward with ``torch:cudnn`` (at S=32K and 128K) and with ``torch:flash``
(at 32K), bf16, Llama-3-8B heads (32 query / 8 KV, d=128) over P=8, flat (p2p zigzag) and a2a+p2p [2, 4], causal,
window (4095, 0) and packed documents; and one megatron-core layer built with our spec, forward. Each case passes when every member's out/lse/dq/dk/dv come back
with the right shapes, dtypes and device and no op raised. The two planted faults show what a rehearsal
catches: a wrong argument type in an op call and a CPU tensor in a CUDA step, each named with where it
happened. What it cannot catch (numbers, the strides only CUDA kernels check, the probe's verdicts) is
for a GPU: see docs/performance.md, "Rehearsed on CPU (estimate)".
"""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcp_context.kernels.torch_sdpa import FUSED_OPS, FusedOp, TorchKernel, _flash_forward
from tests.rehearsal import Case, RehearsalError, rehearse_members

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # FakeTensorMode's "CUDA not available" notes

# cuDNN (the op auto gives blocks over 1K rows) at 32K and 128K; flash (the small-block op) at 32K
CASES = [pytest.param(kernel, Case(seq_len, 8, inner, mask), id=f"{kernel}-{seq_len // 1024}K-"
                      f"{'p2p' if inner == 1 else 'a2a+p2p'}-{mask}")
         for kernel, seq_len, inner, mask in itertools.product(("torch:cudnn", "torch:flash"), (32768, 131072),
                                                               (1, 2), ("causal", "window", "packed"))
         if kernel == "torch:cudnn" or seq_len == 32768]


@pytest.mark.parametrize("kernel,case", CASES)
def test_every_members_cuda_step_rehearses_forward_and_backward(kernel, case):
    assert rehearse_members(case, kernel) > 0


# Today's attention: gpt-oss-like sinks (64/8 heads, d=64, a 127-token window and full layers) through both
# fused ops, and DeepSeek-V3's MLA head dims (192 for q/k, 128 for v, 16/16 heads) through cuDNN, the op
# that declares dv != dqk.
VARIANTS = [pytest.param(kernel, Case(32768, 8, inner, mask, heads=64, kv_heads=8, head_dim=64, sink=True),
                         id=f"{kernel}-sinks-{'p2p' if inner == 1 else 'a2a+p2p'}-{mask}")
            for kernel, inner, mask in itertools.product(("torch:cudnn", "torch:flash"), (1, 2), ("causal", "window"))]
VARIANTS += [pytest.param("torch:cudnn", Case(32768, 8, inner, "causal", heads=16, kv_heads=16, head_dim=192,
                                              v_head_dim=128, sink=sink),
                          id=f"torch:cudnn-mla-{'p2p' if inner == 1 else 'a2a+p2p'}{'-sinks' if sink else ''}")
             for inner, sink in ((1, False), (2, True))]


@pytest.mark.parametrize("kernel,case", VARIANTS)
def test_sinks_and_mla_head_dims_rehearse_through_the_fused_ops(kernel, case):
    assert rehearse_members(case, kernel) > 0


def _flash_backward_with_int_cum_seq(dout, q, k, v, out, lse, causal, scale):
    """The call that crashed our first CUDA path: ints where ``cum_seq_q``/``cum_seq_k`` take tensors."""
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, 0, 0, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)


def test_a_rehearsal_names_a_wrong_op_call():
    planted = TorchKernel(FusedOp("planted_flash", FUSED_OPS["flash"].capabilities, _flash_forward,
                                  _flash_backward_with_int_cum_seq))
    with pytest.raises(RehearsalError) as err:
        rehearse_members(Case(32768, 8, 1, "causal"), planted)
    message = str(err.value)
    assert "torch:planted_flash, member 0 of 8, backward" in message
    assert "_scaled_dot_product_flash_attention_backward" in message and "cum_seq_q" in message


class _MaskOnTheCpu(TorchKernel):
    """cuDNN plus a helper tensor built without ``device=`` (so on the CPU) and used in the CUDA step."""

    def __init__(self):
        super().__init__(FUSED_OPS["cudnn"])
        self.name = "planted_cpu_mask"

    def forward(self, q, k, v, mask, scale, dropout=None):
        out, lse = super().forward(q, k, v, mask, scale, dropout)
        keep = torch.ones(q.shape[2], dtype=torch.bool)  # forgot device=q.device
        return out, lse.masked_fill(~keep, float("-inf"))


def test_a_rehearsal_names_a_cpu_tensor_in_a_cuda_step():
    with pytest.raises(RehearsalError) as err:
        rehearse_members(Case(32768, 8, 2, "window"), _MaskOnTheCpu())
    message = str(err.value)
    assert "planted_cpu_mask, member 0 of 4, forward" in message
    assert "cpu" in message and "cuda:0" in message


def test_a_megatron_layer_with_our_spec_rehearses_its_forward_on_fake_cuda():
    """One megatron-core TransformerLayer (our spec, bf16, 2/1 heads, d=128, 2048 tokens, CP = 1): its forward
    reaches cuDNN through our attention. In a process of its own: it starts a gloo group and patches
    megatron-core's CUDA-only helpers."""
    code = "from tests.rehearsal import rehearse_megatron_layer; print(rehearse_megatron_layer())"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "aten._scaled_dot_product_cudnn_attention.default" in run.stdout.strip().splitlines()[-1]


def test_the_varlen_measurements_calls_rehearse_on_fake_cuda():
    """``tools/kernel_rates.py --parts varlen`` (a packed step's pieces per call against one variable-length flash
    call per mask kind; for the next GPU run): its calls rehearse on fake CUDA bf16 tensors, each way giving every
    task's output in the task's shape; ``varlen_groups`` puts full pieces and causal squares in one call each, in
    task order, and refuses another mask."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mcp_context.masks import BlockMask
    from mcp_context.schedule import BlockTask, layout_schedule
    from tools.kernel_rates import packed_step_calls, varlen_groups
    from tools.step_ops import random_documents

    schedule = layout_schedule("balanced", 4, 2048, random_documents(2048, 9),
                               kernel_masks=frozenset({"full", "causal"}))
    for step in (0, 1):
        tasks = schedule.member_tasks(0)[step]
        groups = varlen_groups(tasks)
        assert sorted(i for _, g in groups for i in g) == list(range(len(tasks))) and len(groups) <= 2
        assert all(tasks[i].mask.kind == ("causal" if causal else "full") for causal, g in groups for i in g)
        with FakeTensorMode():
            q, dout = (torch.empty(512, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            k, v = (torch.empty(512, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            ways = packed_step_calls(tasks, TorchKernel(FUSED_OPS["cudnn"]), TorchKernel(FUSED_OPS["flash"]),
                                     q, k, v, dout, 0.125)
            for name, run in ways.items():
                outs = run()
                assert [tuple(o.shape) for o in outs] == [(t.q[1] - t.q[0], 8, 64) for t in tasks], name
                assert all(o.device.type == "cuda" and o.dtype == torch.bfloat16 for o in outs), name
    band = BlockTask((0, 8), (0, 8), BlockMask(-3, 0))
    with pytest.raises(ValueError, match="full pieces and causal squares, not a band mask"):
        varlen_groups([band])


def test_the_window_measurements_calls_rehearse_on_fake_cuda():
    """``tools/kernel_rates.py --parts window`` (a rank's own sliding window as shipped, its anticausal runs on
    rows flipped, against one flash call with the window native; for the next GPU run): both ways rehearse on
    fake CUDA bf16 tensors with the cuDNN kernel, each giving out, dq, dk and dv in the inputs' shapes; the
    shipped way, what the GPU's flash results are compared with, is the windowed attention (fp64 on the CPU
    against the reference, within 1e-12)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mcp_context.kernels import get_kernel
    from tests.reference import full_attention
    from tools.kernel_rates import window_calls

    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(512, 8, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(512, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    kernel = get_kernel("auto", torch.device("cpu"), torch.float64, head_dim=16)
    got = window_calls(kernel, 63, q, k, v, dout, 0.25)["shipped"]()
    leaves = [x.unsqueeze(1).clone().requires_grad_() for x in (q, k, v)]
    out, _ = full_attention(*leaves, True, 0.25, window=(63, 0))
    out.backward(dout.unsqueeze(1))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, [out, *(x.grad for x in leaves)]):
        assert (a - b.detach().squeeze(1)).abs().max() <= 1e-12, name

    with FakeTensorMode():
        q, dout = (torch.empty(512, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.empty(512, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for name, run in window_calls(TorchKernel(FUSED_OPS["cudnn"]), 63, q, k, v, dout, 0.125).items():
            out, dq, dk, dv = run()
            assert [tuple(x.shape) for x in (out, dq, dk, dv)] == [(512, 8, 64), (512, 8, 64), (512, 2, 64),
                                                                    (512, 2, 64)], name
            assert all(x.device.type == "cuda" and x.dtype == torch.bfloat16 for x in (out, dq, dk, dv)), name
