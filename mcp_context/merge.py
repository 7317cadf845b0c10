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

import functools
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


def merge_blocks_eager_(out: torch.Tensor, lse: torch.Tensor, *blocks: torch.Tensor) -> None:
    """The merge as plain torch operations (any device); see ``merge_blocks_``. The sum is formed where
    ``_scratch`` says and rounded once into ``out`` (a planner's dry run runs this form and counts its
    temporaries, which the compiled kernel does not have)."""
    acc = lse.dtype
    outs, lses = blocks[0::2], [b.to(acc) for b in blocks[1::2]]
    hi = functools.reduce(torch.maximum, lses)
    fin = _finite(hi)
    new_lse = fin + torch.log(functools.reduce(torch.add, [torch.exp(b - fin) for b in lses]))
    ref = _finite(new_lse)
    sums = _scratch(out, outs[0], acc)
    if sums is not outs[0]:
        torch.ops.aten.copy_(sums, outs[0])  # not Tensor.copy_: see algorithms/executor.py's _copy_
    sums.mul_(torch.exp(lses[0] - ref).unsqueeze(-1))
    for o, b in zip(outs[1:], lses[1:]):
        sums.addcmul_(o, torch.exp(b - ref).unsqueeze(-1))
    if sums is not out:
        torch.ops.aten.copy_(out, sums)
    torch.ops.aten.copy_(lse, new_lse)


_merge_blocks = Region(merge_blocks_eager_, "attention merge")


def compiled_merge() -> Callable:
    """``merge_blocks_eager_`` compiled into one kernel (built once; sizes as ``regions.Region.dynamic`` says)."""
    return _merge_blocks.compile()


def merge_blocks_(out: torch.Tensor, lse: torch.Tensor, *blocks: torch.Tensor) -> None:
    """Write the merge of ``blocks`` (``a_out, a_lse, b_out, b_lse, ...``: two or more partial results over
    disjoint key sets) into ``out [..., s, d]`` (any float dtype: rounded once) and ``lse [..., s]`` (the
    accumulator dtype, which the merge computes in): one fused kernel on CUDA, however many blocks.

    Any of them may be views (query sub-ranges). ``out``/``lse`` may be the *first* block itself (an
    accumulator merged in place, or a held block's rows overwritten by the merged result); no other block
    may share their memory. A first block in the accumulator dtype written into an ``out`` that is not (the
    last merge of an fp32 sum) is consumed: its rows are not to be read again.
    """
    _merge_blocks(out, lse, *blocks)


def add_blocks_eager_(out: torch.Tensor, *blocks: torch.Tensor) -> None:
    """``out = sum(blocks)`` summed in fp32 (fp64 when any is fp64), rounded once into ``out``'s dtype (formed
    where ``_scratch`` says)."""
    acc = torch.float64 if any(x.dtype == torch.float64 for x in (out, *blocks)) else torch.float32
    sums = _scratch(out, blocks[0], acc)
    if sums is not blocks[0]:
        torch.ops.aten.copy_(sums, blocks[0])  # not Tensor.copy_: see algorithms/executor.py's _copy_
    for b in blocks[1:]:
        sums.add_(b)
    if sums is not out:
        torch.ops.aten.copy_(out, sums)


_add_blocks = Region(add_blocks_eager_, "dQ sum")


def add_blocks_(out: torch.Tensor, *blocks: torch.Tensor) -> None:
    """``out = sum(blocks)`` in fp32 with one rounding into ``out`` (held dQ blocks and the next, or the fp32 sum
    and the blocks after it): one fused kernel on CUDA, where a copy into fp32 and an add per block were one
    more kernel each. ``out`` may be the first block (a sum added into in place), no other; an fp32 first block
    added into a half-precision ``out`` (the last add of a sum) is consumed, as in ``merge_blocks_``."""
    _add_blocks(out, *blocks)


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


FUSED_REGIONS = {"merge": _merge_blocks, "dq_sum": _add_blocks, "dkv_add": _add_kv, "dkv_first_write": _copy_kv}
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
