"""Online-softmax merging of partial attention results ``(out, lse)`` over disjoint key sets.

Everything is done in the accumulator dtype (fp32, or fp64 for fp64 inputs) in the stable form
``lse = max + log1p(exp(min - max))``; each ``out`` is rescaled by ``exp(lse_i - lse)``. A row that
has seen no visible key yet has ``lse = -inf`` and ``out = 0``; merging two such rows keeps them so,
with no NaN, which is what a fully masked causal chunk needs.

On CUDA the merge is one fused kernel (``regions.Region``: compiled, and called directly where its layout
repeats): eager it is about ten elementwise kernels, 0.98 ms for a ``[1, 32, 16384, 128]`` block on an
H100 against 0.26 ms compiled (memory-bound floor 0.23 ms). If compiling fails the eager form is used,
with one warning naming the reason. The ring's
backward adds each block's dK and dV into one packed fp32 accumulator the same way (``add_kv_``; the rows a
sum's first block writes are written instead of added to zeros: ``copy_kv_``, ``rotation.KeySums``).

An attention sink (gpt-oss's learned softmax offset, or off-by-one's zero) is one more key per head
with score ``s_h`` and a zero value: ``add_sink_`` merges it into the final result once
(``lse' = logaddexp(lse, s_h)``, ``out' = out * exp(lse - lse')``), and ``sink_grad`` gives its gradient,
``-sum_rows rowsum(dout * out') * exp(s_h - lse')`` (the sink's probability times ``0 - delta``).
Rows that see no key (padding rows of packed documents) stay ``(0, -inf)``: they attend to nothing.
"""
from __future__ import annotations

from typing import Callable

import torch

from .regions import Region

NEG_INF = float("-inf")


def _finite(x: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(x == NEG_INF, 0.0)


def _scratch(out: torch.Tensor, a: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """Where an eager pair operation forms its sum: ``out`` when that is in ``acc``; else, run eagerly, ``a``
    when that is an accumulator (the last block of a sum: its rows are not read again), so the eager form
    holds no temporary the compiled kernel does not; else one temporary. Compiled, the temporary is never
    stored (the kernel writes ``out`` directly) and ``a`` is left as it was."""
    if out.dtype == acc:
        return out
    if a.dtype == acc and not torch.compiler.is_compiling():
        return a
    return torch.empty(out.shape, dtype=acc, device=out.device)


def merge_pair_eager_(out: torch.Tensor, lse: torch.Tensor, a_out: torch.Tensor, a_lse: torch.Tensor,
                      b_out: torch.Tensor, b_lse: torch.Tensor) -> None:
    """The merge as plain torch operations (any device); see ``merge_pair_``. The sum is formed where
    ``_scratch`` says and rounded once into ``out`` (a planner's dry run runs this form and counts its
    temporaries, which the compiled kernel does not have)."""
    acc = lse.dtype
    a_lse, b_lse = a_lse.to(acc), b_lse.to(acc)
    hi = torch.maximum(a_lse, b_lse)
    lo = torch.minimum(a_lse, b_lse)
    new_lse = hi + torch.log1p(torch.exp(lo - _finite(hi)))
    ref = _finite(new_lse)
    sums = _scratch(out, a_out, acc)
    if sums is not a_out:
        torch.ops.aten.copy_(sums, a_out)  # not Tensor.copy_: see algorithms/executor.py's _copy_
    sums.mul_(torch.exp(a_lse - ref).unsqueeze(-1))
    sums.addcmul_(b_out, torch.exp(b_lse - ref).unsqueeze(-1))
    if sums is not out:
        torch.ops.aten.copy_(out, sums)
    torch.ops.aten.copy_(lse, new_lse)


_merge_pair = Region(merge_pair_eager_, "attention merge")


def compiled_merge() -> Callable:
    """``merge_pair_eager_`` compiled into one kernel (built once; shapes are dynamic)."""
    return _merge_pair.compile()


def merge_pair_(out: torch.Tensor, lse: torch.Tensor, a_out: torch.Tensor, a_lse: torch.Tensor,
                b_out: torch.Tensor, b_lse: torch.Tensor) -> None:
    """Write the merge of ``(a_out, a_lse)`` and ``(b_out, b_lse)`` (disjoint key sets) into ``out [..., s, d]``
    (any float dtype: rounded once) and ``lse [..., s]`` (the accumulator dtype, which the merge computes in).

    Any of them may be views (query sub-ranges), and ``out``/``lse`` may be ``a_out``/``a_lse`` themselves
    (an accumulator merged in place, or a held block's rows overwritten by the merged result). An ``a_out``
    in the accumulator dtype written into an ``out`` that is not (the last merge of an fp32 sum) is consumed:
    its rows are not to be read again.
    """
    _merge_pair(out, lse, a_out, a_lse, b_out, b_lse)


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold ``(block_out, block_lse)`` into the accumulators ``out [..., s, d]``, ``lse [..., s]`` in place."""
    _merge_pair(out, lse, out, lse, block_out, block_lse)


def add_pair_eager_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a + b`` summed in fp32 (fp64 when any is fp64), rounded once into ``out``'s dtype (formed where
    ``_scratch`` says)."""
    acc = torch.float64 if torch.float64 in (out.dtype, a.dtype, b.dtype) else torch.float32
    sums = _scratch(out, a, acc)
    if sums is not a:
        torch.ops.aten.copy_(sums, a)  # not Tensor.copy_: see algorithms/executor.py's _copy_
    sums.add_(b)
    if sums is not out:
        torch.ops.aten.copy_(out, sums)


_add_pair = Region(add_pair_eager_, "dQ sum")


def add_pair_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a + b`` in fp32 with one rounding into ``out`` (a held dQ block plus the next, or the fp32 sum
    plus the last block): one fused kernel on CUDA, where a copy into fp32 and an add were two. An fp32 ``a``
    added into a half-precision ``out`` (the last block of a sum) is consumed, as in ``merge_pair_``."""
    _add_pair(out, a, b)


def add_kv_eager_(dkv: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """``dkv [..., dqk + dv] += [dk, dv]`` (the columns of a packed dK/dV accumulator); see ``add_kv_``."""
    dqk = dk.shape[-1]
    dkv.narrow(-1, 0, dqk).add_(dk)
    dkv.narrow(-1, dqk, dkv.shape[-1] - dqk).add_(dv)


_add_kv = Region(add_kv_eager_, "dK/dV accumulation")


def add_kv_(dkv: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add a block's ``dk [b, h_kv, n, dqk]`` and ``dv [b, h_kv, n, dv]`` into ``dkv [b, h_kv, n, dqk + dv]``
    (fp32) in place: one fused kernel on CUDA, where eagerly it is two adds with a cast each."""
    _add_kv(dkv, dk, dv)


def copy_kv_eager_(dkv: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """``dkv [..., dqk + dv] = [dk, dv]``, cast to ``dkv``'s dtype; see ``copy_kv_``."""
    dqk = dk.shape[-1]
    torch.ops.aten.copy_(dkv.narrow(-1, 0, dqk), dk)  # not Tensor.copy_: see algorithms/executor.py's _copy_
    torch.ops.aten.copy_(dkv.narrow(-1, dqk, dkv.shape[-1] - dqk), dv)


_copy_kv = Region(copy_kv_eager_, "dK/dV first write")


def copy_kv_(dkv: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Write a block's ``dk``, ``dv`` into unwritten rows of a packed accumulator ``dkv [b, h_kv, n, dqk + dv]``
    (the rows a sum's first block writes, ``rotation.KeySums``): one fused kernel on CUDA, where a fill and
    an add were two."""
    _copy_kv(dkv, dk, dv)


FUSED_REGIONS = {"merge": _merge_pair, "dq_sum": _add_pair, "dkv_add": _add_kv, "dkv_first_write": _copy_kv}
"""Every region compiled on CUDA, by name (``tools/host_costs.py`` runs each eagerly in turn)."""


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
