"""Online-softmax merging of partial attention results ``(out, lse)`` over disjoint key sets.

Everything is done in the accumulator dtype (fp32, or fp64 for fp64 inputs) in the stable form
``lse = max + log1p(exp(min - max))``; each ``out`` is rescaled by ``exp(lse_i - lse)``. A row that
has seen no visible key yet has ``lse = -inf`` and ``out = 0``; merging two such rows keeps them so,
with no NaN, which is what a fully masked causal chunk needs.

On CUDA the merge is one fused kernel (``torch.compile``): eager it is about ten elementwise kernels,
0.98 ms for a ``[1, 32, 16384, 128]`` block on an H100 against 0.26 ms compiled (memory-bound floor
0.23 ms). If compiling fails the eager form is used, with one warning naming the reason.

An attention sink (gpt-oss's learned softmax offset, or off-by-one's zero) is one more key per head
with score ``s_h`` and a zero value: ``add_sink_`` merges it into the final result once
(``lse' = logaddexp(lse, s_h)``, ``out' = out * exp(lse - lse')``), and ``sink_grad`` gives its gradient,
``-sum_rows rowsum(dout * out') * exp(s_h - lse')`` (the sink's probability times ``0 - delta``).
Rows that see no key (padding rows of packed documents) stay ``(0, -inf)``: they attend to nothing.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

NEG_INF = float("-inf")


def _finite(x: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(x == NEG_INF, 0.0)


def merge_eager_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """The merge as plain torch operations (any device); see ``merge_``."""
    block_lse = block_lse.to(lse.dtype)
    hi = torch.maximum(lse, block_lse)
    lo = torch.minimum(lse, block_lse)
    new_lse = hi + torch.log1p(torch.exp(lo - _finite(hi)))
    ref = _finite(new_lse)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1))
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse - ref).unsqueeze(-1))
    torch.ops.aten.copy_(lse, new_lse)  # not Tensor.copy_: see algorithms/executor.py's _copy_


_compiled: Optional[Callable] = None
_compile_error: Optional[str] = None


def compiled_merge() -> Callable:
    """``merge_eager_`` compiled into one kernel (built once; shapes are dynamic)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(merge_eager_, dynamic=True, fullgraph=True)
    return _compiled


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold ``(block_out, block_lse)`` into the accumulators ``out [..., s, d]``, ``lse [..., s]`` in place.

    ``out``/``lse`` may be views (a query sub-range of the full accumulator).
    """
    global _compile_error
    if out.is_cuda and not is_fake(out) and _compile_error is None:  # a fake-CUDA rehearsal cannot compile
        try:
            compiled_merge()(out, lse, block_out, block_lse)
            return
        except Exception as err:  # noqa: BLE001 - compilation fails before anything is written
            _compile_error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            warnings.warn(f"torch.compile of the attention merge failed ({_compile_error}); merging eagerly "
                          f"(slower, same results)", stacklevel=2)
    merge_eager_(out, lse, block_out, block_lse)


def add_sink_(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> None:
    """Merge a per-head sink ``sink [h]`` into final accumulators ``out [b, h, s, dv]``, ``lse [b, h, s]``
    in place; rows with ``lse = -inf`` (nothing visible) are left as they are."""
    s = sink.to(lse.dtype).view(1, -1, 1)
    new_lse = torch.where(lse == NEG_INF, lse, torch.logaddexp(lse, s))
    out.mul_(torch.exp(lse - _finite(new_lse)).unsqueeze(-1))
    torch.ops.aten.copy_(lse, new_lse)  # not Tensor.copy_: see algorithms/executor.py's _copy_


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``d loss / d sink [h]`` (accumulator dtype) over these rows, from ``dout``/``out [b, h, s, dv]`` (the
    sink-merged ``out'``) and the sink-merged ``lse [b, h, s]`` with ``-inf`` already made ``+inf``."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    return -(delta * torch.exp(sink.to(acc).view(1, -1, 1) - lse)).sum(dim=(0, 2))
