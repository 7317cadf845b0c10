"""Which block kernel serves a (device, dtype, head dims): declared capabilities, a probe, a choice.

Backends: ``math`` (pure torch, always serves), the fused torch ops ``torch:cpu_flash``,
``torch:cudnn``, ``torch:flash``, ``torch:efficient``, and ``te`` (a reserved slot that refuses
loudly). A backend whose declared ``Capabilities`` exclude the request is not tried; one that may
serve is probed once per (device type, dtype, head_dim, v_head_dim) on the shapes a schedule sends:
``[b, h, s, d]`` views (b = 2) of ``[s, b, h, d]`` storage at row offsets, a GQA causal square, a
rectangular full block and, where declared, an anticausal square, forward and backward from the final
``(out, lse)``, against the math kernel. *Any* exception or disagreement means "does not serve here",
and the reason is kept for ``python -m mcp_context.kernels`` and for error messages.

Under torch's ``FakeTensorMode`` (a rehearsal: tensors with shapes and devices but no numbers, e.g.
``device="cuda"`` on a CPU-only torch) no probe can run: the declared capabilities are trusted and the
verdict says ``rehearsal: not probed``.

``auto`` takes the fastest op that serves: on CUDA cuDNN for the blocks long contexts have and flash
for blocks of at most ``SMALL_BLOCK_ROWS`` rows when both serve (H100, bf16, d=128, causal fwd+bwd:
flash 68 vs cuDNN 56 TFLOP/s at 1K rows, cuDNN ahead from 2K on: 206 vs 166, 511 vs 280 at 8K),
then efficient, then math; on the CPU ``cpu_flash``, then math. A probe cannot try every shape: when
an op raises on a block shape during a step, ``auto`` (and ``torch``) records why, warns once, and
sends that shape to the next op that serves (``FallbackKernel``); a named op raises.

With dropout only the math kernel can replay a block's mask. On CUDA its fp32 score matrix is O(s^2):
a shard whose largest block's scores would exceed ``MATH_SCORES_MAX_GIB`` (default 2 GiB, env
``MCP_CONTEXT_MATH_SCORES_MAX_GIB``) is refused with the fix named (attention dropout 0).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from ..errors import first_line
from ..masks import ANTICAUSAL_BLOCK, CAUSAL_BLOCK, FULL_BLOCK, block_mask
from .base import Capabilities, Kernel
from .math import MathKernel
from .te import TEKernel
from .torch_sdpa import FUSED_OPS, TorchKernel

FUSED_NAMES = tuple(f"torch:{name}" for name in FUSED_OPS)
BACKENDS = ("auto", "math", "torch") + FUSED_NAMES + ("te",)
AUTO_ORDER = {"cpu": ("torch:cpu_flash",), "cuda": ("torch:cudnn", "torch:flash", "torch:efficient")}
SMALL_BLOCK_ROWS = 1024
PROBE_HEAD_DIM = 16
NOT_PROBED = "rehearsal: not probed"
MATH_SCORES_MAX_GIB = 2.0  # default bound on the math kernel's score matrix on CUDA (dropout); env overrides
MATH_SCORES_ENV = "MCP_CONTEXT_MATH_SCORES_MAX_GIB"


def rehearsing() -> bool:
    """True under torch's ``FakeTensorMode``: tensors have shapes and devices but no numbers to probe."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


@dataclass(frozen=True)
class Verdict:
    """Whether backend ``name`` serves a (device, dtype, head dims): the kernel, or the reason it does
    not. A serving kernel's ``reason`` is a note on how it was judged (``rehearsal: not probed``)."""

    name: str
    kernel: Optional[Kernel]
    reason: Optional[str] = None

    @property
    def summary(self) -> str:
        if self.kernel is None:
            return str(self.reason)
        return "serves" if self.reason is None else f"serves ({self.reason})"


class SizeDispatchKernel:
    """Two kernels that both serve, each taking the blocks it is faster on (decided by block rows,
    so a block's backward always runs on the kernel that ran its forward)."""

    def __init__(self, small: Kernel, large: Kernel, max_small_rows: int = SMALL_BLOCK_ROWS):
        self.small, self.large, self.max_small_rows = small, large, max_small_rows
        self.name = f"{large.name}+{small.name.split(':')[-1]}<={max_small_rows}"
        self.capabilities: Capabilities = large.capabilities

    def _pick(self, q: torch.Tensor, k: torch.Tensor, mask) -> Kernel:
        """By the rows of one call's blocks: a diagonal run (``BlockMask.diagonal``) is many small ones."""
        rows = max(q.shape[2], k.shape[2]) // block_mask(mask).diagonal
        return self.small if rows <= self.max_small_rows else self.large

    def forward(self, q, k, v, causal, scale, dropout=None):
        return self._pick(q, k, causal).forward(q, k, v, causal, scale, dropout)

    def backward(self, dout, q, k, v, out, lse, causal, scale, dropout=None):
        return self._pick(q, k, causal).backward(dout, q, k, v, out, lse, causal, scale, dropout)


def _block_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> tuple:
    """What a block's kernel call depends on besides numbers: shapes, strides, dtype, mask."""
    return (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.stride(), k.stride(), v.stride(), q.dtype,
            block_mask(mask))


class FallbackKernel:
    """Kernels in order of preference, the last one the math kernel. A block shape an op raises on (no
    probe tries every shape a schedule emits) is recorded with the reason, warned about once, and sent to
    the next kernel from then on; that call too. The backward of a block needs only the final
    ``(out, lse)``, so its forward and backward may run on different kernels. Under a rehearsal (fake
    tensors) nothing is absorbed: an op's error is what the rehearsal is for."""

    def __init__(self, kernels: Sequence[Kernel]):
        self.kernels = tuple(kernels)
        first = self.kernels[0]
        self.name, self.capabilities = first.name, first.capabilities
        for later in self.kernels[1:]:
            if not first.capabilities.masks <= later.capabilities.masks:
                raise ValueError(f"{later.name} cannot take every block mask {first.name} takes "
                                 f"({sorted(first.capabilities.masks)}); it cannot be its fallback")
        self.failures: dict[tuple, dict[str, str]] = {}  # block key -> {kernel name: reason}

    def __repr__(self) -> str:
        return f"FallbackKernel({' -> '.join(k.name for k in self.kernels)})"

    def _call(self, key_of: Callable[[], tuple], run):
        """``run(kernel)`` on the first kernel that has not failed on this block's shape. The shape's key
        (``key_of()``) is made only where some shape has failed or this call raises: most steps never pay for it."""
        key = key_of() if self.failures else None
        failed = self.failures.get(key, {}) if key is not None else {}
        chain = [k for k in self.kernels if k.name not in failed] if failed else self.kernels
        for i, kernel in enumerate(chain):
            if i == len(chain) - 1:
                return run(kernel)
            try:
                return run(kernel)
            except Exception as err:  # noqa: BLE001 - any exception: this op does not serve this shape
                if rehearsing():  # an op's error is what a rehearsal is for: nothing absorbed
                    raise
                key = key_of() if key is None else key
                reason = first_line(err, 300)
                self.failures.setdefault(key, {})[kernel.name] = reason
                warnings.warn(f"{kernel.name} failed on a {key[-1].kind} block q{list(key[0])} k{list(key[1])} "
                              f"v{list(key[2])} ({reason}); this block shape goes to {chain[i + 1].name} from now "
                              f"on (FallbackKernel.failures keeps the reason)", stacklevel=3)
        raise AssertionError("unreachable: the last kernel's call returns or raises")

    def forward(self, q, k, v, mask, scale, dropout=None):
        return self._call(lambda: _block_key(q, k, v, mask), lambda kern: kern.forward(q, k, v, mask, scale, dropout))

    def backward(self, dout, q, k, v, out, lse, mask, scale, dropout=None):
        return self._call(lambda: _block_key(q, k, v, mask),
                          lambda kern: kern.backward(dout, q, k, v, out, lse, mask, scale, dropout))


_VERDICTS: dict[tuple, Verdict] = {}


def _bhsd_view(storage: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    """Rows ``offset:offset + rows`` of ``[s, b, h, d]`` storage as the ``[b, h, rows, d]`` view a schedule
    hands a kernel (a permute, no copy)."""
    return storage.narrow(0, offset, rows).permute(1, 2, 0, 3)


PROBE_BATCH, PROBE_HEADS, PROBE_KV_HEADS = 2, 4, 2
# (mask, query rows, key rows, query row offset, key row offset) in 64-row storage
PROBE_BLOCKS = ((CAUSAL_BLOCK, 40, 40, 8, 16), (FULL_BLOCK, 40, 24, 0, 37), (ANTICAUSAL_BLOCK, 24, 24, 33, 5))


def _disagreement(kernel: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int,
                  v_head_dim: Optional[int] = None) -> Optional[str]:
    """None when ``kernel`` matches the math kernel on this device and dtype, else what differed.

    The blocks are what a schedule sends: ``[b, h, s, d]`` views (b = 2) of ``[s, b, h, d]`` storage at
    row offsets, GQA, and the merged ``out`` in that storage too, as the executor passes it."""
    gen = torch.Generator().manual_seed(0)
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    dv = head_dim if v_head_dim is None else v_head_dim
    math_kernel = MathKernel()
    b, h, h_kv, s = PROBE_BATCH, PROBE_HEADS, PROBE_KV_HEADS, 64

    def storage(heads: int, d: int) -> torch.Tensor:
        return torch.randn(s, b, heads, d, generator=gen).to(device, dtype)

    for mask, sq, sk, q0, k0 in PROBE_BLOCKS:
        if mask.kind not in kernel.capabilities.masks:
            continue
        q, dout = _bhsd_view(storage(h, head_dim), q0, sq), _bhsd_view(storage(h, dv), q0, sq)
        k, v = _bhsd_view(storage(h_kv, head_dim), k0, sk), _bhsd_view(storage(h_kv, dv), k0, sk)
        scale = head_dim ** -0.5
        ref_out, ref_lse = math_kernel.forward(q, k, v, mask, scale)
        out_storage = torch.zeros(s, b, h, dv, device=device, dtype=dtype)
        out_storage[q0:q0 + sq] = ref_out.permute(2, 0, 1, 3).to(dtype)
        merged_out = _bhsd_view(out_storage, q0, sq)
        got = kernel.forward(q, k, v, mask, scale)
        grads = kernel.backward(dout, q, k, v, merged_out, ref_lse, mask, scale)
        ref_grads = math_kernel.backward(dout, q, k, v, merged_out, ref_lse, mask, scale)
        for what, a, r in zip(("out", "lse", "dq", "dk", "dv"), tuple(got) + tuple(grads), (ref_out, ref_lse)
                              + tuple(ref_grads)):
            if a.shape != r.shape:
                return f"{what} has shape {tuple(a.shape)}, expected {tuple(r.shape)}"
            err = (a.float() - r.float()).abs().max().item()
            if not err <= tol * (1 + r.float().abs().max().item()):
                return (f"disagrees with the math kernel ({mask.kind} block {sq}x{sk}, b={b}, dqk={head_dim}, dv={dv}): "
                        f"max error {err:.2e} in {what}, tolerance {tol:.0e}")
    return None


def probe(name: str, device: torch.device, dtype: torch.dtype, dropout: bool = False,
          head_dim: int = PROBE_HEAD_DIM, v_head_dim: Optional[int] = None) -> Verdict:
    """Whether backend ``name`` (``math``, ``torch:<op>`` or ``te``) serves here; cached per process
    (and separately under a rehearsal). ``v_head_dim``: the value head dim, if not ``head_dim``."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    key = (name, device.type, dtype, bool(dropout), head_dim, v_head_dim, rehearsing())
    if key in _VERDICTS:
        return _VERDICTS[key]
    if name == "te":
        try:
            kernel: Kernel = TEKernel(device, dtype)
            verdict = Verdict(name, kernel)
        except Exception as err:  # noqa: BLE001 - any failure means TE does not serve here
            verdict = Verdict(name, None, first_line(err, 300))
    else:
        kernel = MathKernel() if name == "math" else TorchKernel(FUSED_OPS[name.split(":", 1)[1]])
        reason = None if name == "math" else refusal(kernel, device, dtype, dropout, head_dim, v_head_dim)
        if reason is None and name != "math" and rehearsing():
            verdict = Verdict(name, kernel, NOT_PROBED)
        else:
            verdict = Verdict(name, kernel if reason is None else None, reason)
    _VERDICTS[key] = verdict
    return verdict


def refusal(kernel: Kernel, device: torch.device, dtype: torch.dtype, dropout: bool = False,
            head_dim: int = PROBE_HEAD_DIM, v_head_dim: Optional[int] = None) -> Optional[str]:
    """Why ``kernel`` does not serve here (its declared capabilities, then a probe run), or None.

    Any exception the probe raises, of any type, is a refusal with its first line as the reason. Under
    a rehearsal (fake tensors) and on ``meta`` only the declared capabilities are checked."""
    distinct = v_head_dim is not None and v_head_dim != head_dim
    reason = kernel.capabilities.refusal(device, dtype, bool(dropout), distinct)
    if reason is None and device.type != "meta" and not rehearsing():
        try:
            reason = _disagreement(kernel, device, dtype, head_dim, v_head_dim)
        except Exception as err:  # noqa: BLE001 - any exception means "does not serve here"
            reason = first_line(err, 300)
    return reason


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; choose one of {', '.join(BACKENDS)}")


def _fastest_fused(device: torch.device, dtype: torch.dtype, head_dim: int,
                   v_head_dim: Optional[int]) -> Optional[Kernel]:
    """The fused ops that serve, in ``auto``'s order, each falling back to the others and then math."""
    serving = [v.kernel for n in AUTO_ORDER.get(device.type, ())
               if (v := probe(n, device, dtype, head_dim=head_dim, v_head_dim=v_head_dim)).kernel is not None]
    if not serving:
        return None
    names = [k.name for k in serving]
    if "torch:cudnn" in names and "torch:flash" in names:
        cudnn, flash = serving[names.index("torch:cudnn")], serving[names.index("torch:flash")]
        rest = [k for k in serving if k not in (cudnn, flash)]
        return SizeDispatchKernel(small=FallbackKernel([flash, cudnn, *rest, MathKernel()]),
                                  large=FallbackKernel([cudnn, flash, *rest, MathKernel()]))
    return FallbackKernel([*serving, MathKernel()])


def math_scores_max_gib() -> float:
    """The bound on the math kernel's score matrix on CUDA: ``MCP_CONTEXT_MATH_SCORES_MAX_GIB`` or 2 GiB."""
    raw = os.environ.get(MATH_SCORES_ENV)
    if raw is None:
        return MATH_SCORES_MAX_GIB
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{MATH_SCORES_ENV}={raw!r} must be a positive number of GiB, e.g. 2")
    return value


def _check_math_scores(device: torch.device, dropout: float, rows: Optional[int], heads: Optional[int]) -> None:
    """Refuse attention dropout on CUDA where the math kernel's fp32 scores for the largest block (at most
    ``rows x rows`` for ``heads`` = batch x query heads) would exceed the bound; the fix is dropout 0."""
    if device.type != "cuda" or rows is None or heads is None:
        return
    gib = heads * rows * rows * 4 / 2**30
    bound = math_scores_max_gib()
    if gib > bound:
        value = "> 0" if isinstance(dropout, bool) else f"={dropout}"
        raise ValueError(
            f"attention dropout (dropout_p{value}; Megatron's attention_dropout, --attention-dropout, defaults to "
            f"0.1) sends every block to the math kernel, whose fp32 score matrix for this shard's largest block "
            f"({heads} batch x heads, {rows} x {rows} rows) takes {gib:.1f} GiB on CUDA, over the {bound:g} GiB "
            f"bound ({MATH_SCORES_ENV}); train with --attention-dropout 0 (dropout_p=0.0), as long-context recipes "
            f"do, or raise {MATH_SCORES_ENV} if the memory is there")


def get_kernel(backend: str, device: torch.device, dtype: torch.dtype, dropout: Union[bool, float] = False,
               head_dim: int = PROBE_HEAD_DIM, v_head_dim: Optional[int] = None, rows: Optional[int] = None,
               heads: Optional[int] = None) -> Kernel:
    """The kernel for ``backend`` on this device and dtype (``auto``: the fastest op that serves).

    ``dropout``: the attention dropout probability (or a bool). ``head_dim``/``v_head_dim``: query/key and
    value head dims (``v_head_dim`` defaults to ``head_dim``). ``rows``: query rows one ring member computes
    (``s_local`` times the all-to-all degree); ``heads``: batch times the query heads it computes (``b * h``
    over the all-to-all degree); with both, dropout on CUDA is refused where the math kernel's scores would
    exceed ``math_scores_max_gib()``. A named op that does not serve raises a ValueError with the probe's
    reason; ``torch`` (any fused op) warns and uses the math kernel when none serves; ``auto`` uses it
    silently. ``auto`` and ``torch`` fall back per block shape (``FallbackKernel``)."""
    check_backend(backend)
    if backend == "te":
        return TEKernel(device, dtype)
    if dropout and backend in ("auto", "math"):
        _check_math_scores(device, dropout, rows, heads)
    if backend == "math" or (backend == "auto" and dropout):
        return MathKernel()
    if dropout:
        raise ValueError(f"backend={backend!r} cannot apply attention dropout inside the ring (the fused ops draw "
                         f"their own masks); use backend='auto' or 'math', or dropout 0")
    if backend in FUSED_NAMES:
        verdict = probe(backend, device, dtype, head_dim=head_dim, v_head_dim=v_head_dim)
        if verdict.kernel is None:
            dims = "" if v_head_dim in (None, head_dim) else f" with head_dim={head_dim}, v_head_dim={v_head_dim}"
            raise ValueError(f"backend={backend!r} does not serve {dtype} on {device.type}{dims} here: "
                             f"{verdict.reason}; use backend='auto' (see `python -m mcp_context.kernels`)")
        return verdict.kernel
    fused = _fastest_fused(device, dtype, head_dim, v_head_dim)
    if fused is not None:
        return fused
    if backend == "torch":
        warnings.warn(f"no fused torch attention op supports {dtype} on {device.type} here; using the math kernel "
                      f"(see `python -m mcp_context.kernels` for why)", stacklevel=2)
    return MathKernel()


def kernel_report(device: torch.device, dtype: torch.dtype, head_dim: int = PROBE_HEAD_DIM,
                  v_head_dim: Optional[int] = None) -> dict:
    """What ``auto`` picks here and, for every backend, whether it serves and why not."""
    verdicts = [probe(name, device, dtype, head_dim=head_dim, v_head_dim=v_head_dim)
                for name in ("math",) + FUSED_NAMES + ("te",)]
    return {"device": device.type, "dtype": str(dtype).replace("torch.", ""), "head_dim": head_dim,
            "v_head_dim": head_dim if v_head_dim is None else v_head_dim,
            "auto": get_kernel("auto", device, dtype, head_dim=head_dim, v_head_dim=v_head_dim).name,
            "backends": {v.name: v.summary for v in verdicts}}
