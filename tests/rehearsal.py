"""Rehearse the CUDA path on a CPU-only torch: every ring member's schedule on fake CUDA tensors.

Under ``FakeTensorMode`` a tensor made with ``device="cuda"`` has a shape, a dtype, strides and a
device but no numbers, and every aten op runs only its shape function. So the ring executor, the
kernels' op calls (their schemas) and the merge run as on a GPU, and a wrong argument type, dtype,
shape or a CPU tensor mixed into the step raises here, before any GPU sees the code. Numbers, the
strides only CUDA kernels check, and anything a probe decides are not rehearsed (the registry trusts
declared capabilities under fake tensors and says so).

One member's step is run the way the one-GPU member harness runs it (``tests/test_member_schedules``):
member ``m`` of a ring of ``P / inner`` walks ``LocalRotation(m, ring)`` over every member's K/V shard
laid out on the device; ``inner = 2`` is one all-to-all rank of an ``a2a+p2p [2, P/2]`` member (its
``h / 2`` query heads and their KV heads). The autograd engine aborts the process on fake CUDA tensors
on the CPU wheel, so the backward is driven directly (``ring_backward``), never through autograd.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mcp_context.algorithms.executor import RingPlan, ring_backward, ring_forward
from mcp_context.algorithms.rotation import LocalRotation
from mcp_context.kernels import Kernel, get_kernel
from mcp_context.masks import CAUSAL, Mask, attention_mask, documents_mask
from mcp_context.schedule import layout_schedule

CUDA = torch.device("cuda")


@dataclass(frozen=True)
class Case:
    """One rehearsal: a sequence of ``seq_len`` tokens over ``cp`` ranks (``inner = 2``: a2a+p2p [2, cp/2])."""

    seq_len: int
    cp: int
    inner: int
    mask_name: str  # "causal", "window" (4095, 0) or "packed" (two causal documents, 3/4 and 1/4)
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    v_head_dim: Optional[int] = None  # MLA: the value head dim (default head_dim)
    sink: bool = False  # attention sinks (softmax_offset), merged after the ring

    @property
    def batch(self) -> int:
        return 1 if self.mask_name == "packed" else 2  # a packed sequence is one sequence

    def mask(self) -> Mask:
        if self.mask_name == "causal":
            return CAUSAL
        if self.mask_name == "window":
            return attention_mask(True, (4095, 0))
        s = self.seq_len
        return documents_mask([0, s - s // 4, s], within=CAUSAL, seq_len=s)

    def __str__(self) -> str:
        comm = "p2p" if self.inner == 1 else f"a2a+p2p [{self.inner}, {self.cp // self.inner}]"
        dims = f"d={self.head_dim}" + (f"/{self.v_head_dim}" if self.v_head_dim else "")
        return (f"S={self.seq_len} P={self.cp} {comm} {self.mask_name} h={self.heads}/{self.kv_heads} {dims}"
                + (" sinks" if self.sink else ""))


class RehearsalError(AssertionError):
    """What failed, where: the case, the kernel, the member and forward or backward, then torch's error."""


def _check(name: str, x: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(x.shape) != shape or x.dtype != dtype or x.device.type != "cuda":
        raise ValueError(f"{name} came back {tuple(x.shape)} {x.dtype} on {x.device}, expected {shape} {dtype} on cuda")


def rehearse_members(case: Case, kernel: Union[str, Kernel]) -> int:
    """Run every member's forward and backward of ``case`` on fake CUDA tensors with ``kernel`` (a backend
    name for ``get_kernel`` or a kernel); returns the number of block tasks run. Raises ``RehearsalError``
    naming the case, kernel, member and pass, with torch's error, when anything fails."""
    with FakeTensorMode():
        if isinstance(kernel, str):
            kernel = get_kernel(kernel, CUDA, case.dtype, head_dim=case.head_dim, v_head_dim=case.v_head_dim)
        schedule = layout_schedule("zigzag", case.cp, case.seq_len, case.mask(), case.inner,
                                   kernel.capabilities.masks)
        ring, b, d = schedule.ring_size, case.batch, case.head_dim
        dv = case.v_head_dim or d
        h, h_kv = case.heads // case.inner, max(1, case.kv_heads // case.inner)
        rows = case.seq_len // ring

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, device=CUDA, dtype=case.dtype)

        k_all, v_all = empty(case.seq_len, b, h_kv, d), empty(case.seq_len, b, h_kv, dv)  # every member's shard
        sink = torch.empty(h, device=CUDA, dtype=torch.float32) if case.sink else None
        tasks = 0
        for member in range(ring):
            q, dout = empty(rows, b, h, d), empty(rows, b, h, dv)
            plan = RingPlan.build(schedule.tasks[member], LocalRotation(member, ring), kernel, d ** -0.5, rows)
            tasks += sum(len(step) for step in schedule.tasks[member])
            where = f"rehearsal of {case} with {kernel.name}, member {member} of {ring}"
            phase = "forward"
            try:
                out, lse = ring_forward(q, k_all, v_all, plan, sink)
                _check("out", out, (rows, b, h, dv), case.dtype)
                _check("lse", lse, (b, h, rows), torch.float32)
                phase = "backward"
                dq, dk, dv_, dsink = ring_backward(dout, q, k_all, v_all, out, lse, plan, sink)
                _check("dq", dq, tuple(q.shape), case.dtype)
                _check("dk", dk, tuple(k_all.shape), case.dtype)
                _check("dv", dv_, tuple(v_all.shape), case.dtype)
                if sink is not None:
                    _check("dsink", dsink, (h,), torch.float32)
            except Exception as err:  # noqa: BLE001 - every error is what the rehearsal reports
                raise RehearsalError(f"{where}, {phase}: {type(err).__name__}: {err}") from err
    return tasks


def rehearse_megatron_layer(seq_len: int = 2048, hidden: int = 256, heads: int = 2, groups: int = 1) -> list[str]:
    """One megatron-core ``TransformerLayer`` built with our layer spec (``get_gpt_layer_hcp_spec``), its
    forward on fake CUDA bf16 tensors at CP = 1: returns the attention ops it ran.

    Run it in a process of its own (it starts a one-rank gloo group and applies the CPU shims). The layer is
    built on the CPU (megatron-core creates CUDA weights on ``torch.cuda.current_device()``, which a
    CPU-only torch has not), its weights are replaced by fake CUDA tensors of the same shapes
    (``torch.func.functional_call``), and the forward runs without gradients (the autograd engine aborts on
    fake CUDA tensors). RoPE is left out: its ``inv_freq`` is placed by the CPU shims on the CPU."""
    import tempfile

    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module
    from torch.utils._python_dispatch import TorchDispatchMode

    from mcp_context.megatron.specs import get_gpt_layer_hcp_spec
    from megatron_patches.cpu_shims import apply_cpu_shims

    class AttentionOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in str(func):
                self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        apply_cpu_shims("cpu")
        model_parallel_cuda_manual_seed(0)
        config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                                   ffn_hidden_size=4 * hidden, gated_linear_unit=True, activation_func=F.silu,
                                   normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                                   hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
                                   bias_activation_fusion=False, bias_dropout_fusion=False,
                                   gradient_accumulation_fusion=False, params_dtype=torch.bfloat16, bf16=True)
        layer = build_module(get_gpt_layer_hcp_spec(), config=config, layer_number=1)
        real = dict(list(layer.named_parameters()) + list(layer.named_buffers()))
        ops = AttentionOps()
        with FakeTensorMode():
            weights = {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=CUDA) for n, t in real.items()}
            x = torch.empty(seq_len, 1, hidden, device=CUDA, dtype=torch.bfloat16)
            with torch.no_grad(), ops:
                out, _ = torch.func.functional_call(layer, weights, (x,), {"attention_mask": None})
            _check("the layer's output", out, (seq_len, 1, hidden), torch.bfloat16)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return sorted(ops.seen)
