#!/usr/bin/env python
"""Count the work one rank's attention step does outside the attention calls, without a GPU.

The CUDA path is rehearsed on fake CUDA tensors (``FakeTensorMode``: shapes, no numbers) with the cuDNN
op, and every aten op the executor dispatches is recorded by a ``TorchDispatchMode``:

- attention ops (``_scaled_dot_product_*``) are counted apart, as calls;
- ops that launch no kernel are not counted: views (``narrow``, ``permute``, ``reshape`` of a view, ...)
  and allocations (``empty``, ``empty_strided``);
- a fused region (``merge.merge_blocks_``, ``merge.add_blocks_``, ``merge.add_kv_``, compiled on a GPU) counts as
  the kernels the H200 profile shows it launching (``FUSED``: the merge is two, its output and its lse;
  the adds one), whatever eager ops it runs here; its bytes are its operands' sizes (each read or
  written once, an accumulator it adds into both);
- every other op counts as one kernel; its bytes are the tensors it reads plus the tensors it writes
  (``copy_``/``fill_`` read only their source).

Beside the kernels, ``host_ops`` counts what the host dispatches: every aten op outside the fused regions, views
and allocations included, the attention calls too, and each fused region's call as one (on a GPU a direct call
into its compiled code, ``regions``). Each costs the host a few µs whatever the tensors' sizes, and a short step
is the host's (docs/performance.md), so the count is pinned too.

What a GPU adds that this cannot see: the kernels inside the attention ops (cuDNN's dq conversion, for
one) and the launches of the communication. The counts are the forward and the backward of
``ring_forward``/``ring_backward`` for one rank (``tools/rank_step.py``), as tests/test_step_ops.py pins
them per scheme, so a change that adds work to the hot path fails a test.

    python tools/step_ops.py --seq-len 32768 --cp 8            # every scheme, Llama-3-8B heads
    python tools/step_ops.py --seq-len 32768 --cp 8 --documents 50   # a packed batch of 50 documents
    python tools/step_ops.py --seq-len 131072 --cp 8 --window 4095,0 --layout contiguous   # a sliding window

A window's lower edge is computed on its rows reversed (``torch_sdpa``: an anticausal run is a causal one
flipped), so a windowed step's ``flip`` copies show here.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from mcp_context import merge  # noqa: E402
from mcp_context.algorithms.executor import ring_backward, ring_forward  # noqa: E402
from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel  # noqa: E402
from mcp_context.masks import CAUSAL, Mask, attention_mask  # noqa: E402
from mcp_context.plan.__main__ import window_pair  # noqa: E402
from tools.rank_step import SCHEMES, kv_inputs, rank_step  # noqa: E402

CUDA = torch.device("cuda")
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "narrow", "slice", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand",
    "as_strided", "alias", "detach", "select", "unflatten", "split", "split_with_sizes", "unbind", "movedim",
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "flip_view",
})
WRITE_ONLY_FIRST = frozenset({"copy_", "fill_", "zero_"})
FUSED = {"merge_blocks_": (2, True), "add_blocks_": (1, True), "add_kv_": (1, False), "copy_kv_": (1, True)}
"""Per compiled region: the kernels it launches on a GPU, and whether its destinations are only written
(else the first operand is read and written). torch.profiler on an H200, torch 2.11,
docs/gpu/h200_run2_profile.jsonl: the merge is ``triton_poi_fused_..._mul`` + ``..._sub_1`` (its out and its
lse), the dK/dV add one kernel. A merge of more than two blocks is taken as two kernels too, and the dQ sums
and the dK/dV first write, pointwise regions of one output each, as one: not yet profiled."""


def region_attr(name: str) -> str:
    """The ``merge`` attribute holding the compiled region behind public function ``name`` of ``FUSED``
    (``merge_blocks_`` -> ``_merge_blocks``)."""
    return f"_{name.rstrip('_')}"


def _nbytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


@dataclass
class Tally:
    """Ops outside attention (``ops``, by name in ``by_op``), their bytes (by name in ``bytes_by_op``),
    attention calls, and every op the host dispatches (``host_ops``: the module's docstring)."""

    ops: int = 0
    bytes: int = 0
    attention_calls: int = 0
    host_ops: int = 0
    by_op: Counter = field(default_factory=Counter)
    bytes_by_op: Counter = field(default_factory=Counter)

    def add(self, name: str, nbytes: int, kernels: int = 1) -> None:
        self.ops += kernels
        self.bytes += nbytes
        self.by_op[name] += kernels
        self.bytes_by_op[name] += nbytes


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.tally = Tally()
        self.suspended = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.suspended:
            return out
        name = func.overloadpacket.__name__
        if func.namespace == "prim":  # metadata queries (a tensor's device, sizes): no kernel
            return out
        self.tally.host_ops += 1
        if "scaled_dot_product" in name:
            self.tally.attention_calls += 1
        elif name not in NO_KERNEL and not (name == "view" or name.endswith("_view")):
            inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
            reads = inputs[1:] if name in WRITE_ONLY_FIRST else inputs
            written = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
            self.tally.add(name, sum(map(_nbytes, reads)) + sum(map(_nbytes, written)))
        return out


@contextlib.contextmanager
def counting() -> Iterator[_Counter]:
    """Count ops (see the module docstring); each fused region counts once with its operands' bytes."""
    counter = _Counter()
    originals = {name: getattr(merge, region_attr(name)) for name in FUSED}

    def fused(name, region):
        def run(*args):
            kernels, write_only = FUSED[name]  # every operand moved once; an accumulator read too
            counter.tally.add(name, sum(map(_nbytes, args)) + (0 if write_only else _nbytes(args[0])), kernels)
            counter.tally.host_ops += 1
            counter.suspended += 1
            try:
                region.eager(*args)
            finally:
                counter.suspended -= 1
        return run

    for name, region in originals.items():
        setattr(merge, region_attr(name), fused(name, region))
    try:
        with counter:
            yield counter
    finally:
        for name, region in originals.items():
            setattr(merge, region_attr(name), region)


@dataclass(frozen=True)
class StepCount:
    """One rank's step: the forward's and backward's tallies, and what the step's outputs weigh."""

    comm: str
    calls: int
    forward: Tally
    backward: Tally
    output_bytes: int
    """out + lse + dq + dk + dv of the rank: its own shard's, what the step hands back to the layer."""

    @property
    def ops(self) -> int:
        return self.forward.ops + self.backward.ops

    @property
    def bytes(self) -> int:
        return self.forward.bytes + self.backward.bytes

    @property
    def host_ops(self) -> int:
        return self.forward.host_ops + self.backward.host_ops


def count_step(comm: str, seq_len: int, cp: int, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
               mask: Mask = CAUSAL, inner: int = 2, rank: int = 0, op: str = "cudnn", layout: str = "zigzag"
               ) -> StepCount:
    """Count rank ``rank``'s forward and backward of ``comm`` on fake CUDA bf16 tensors (batch 1): a ring as the
    member walks it (``RankStep.walked``: its own shard's K/V, packed into messages), the other kinds over
    the K/V they hold after their collectives."""
    kernel = TorchKernel(FUSED_OPS[op])
    step = rank_step(comm, cp, seq_len, mask, kernel, heads, kv_heads, head_dim, inner, layout, rank)
    dtype = torch.bfloat16
    with FakeTensorMode():
        def empty(*shape):
            return torch.empty(*shape, device=CUDA, dtype=dtype)

        plan, kv_rows = step.walked()
        q, dout = empty(step.q_rows, 1, step.heads, head_dim), empty(step.q_rows, 1, step.heads, head_dim)
        k, v = kv_inputs(step, lambda dims: empty(kv_rows, 1, step.kv_heads, dims), head_dim)
        ring_backward(dout, q, k, v, *ring_forward(q, k, v, plan), plan)  # warm: per-process constants
        with counting() as fwd:
            out, lse = ring_forward(q, k, v, plan)
        with counting() as bwd:
            ring_backward(dout, q, k, v, out, lse, plan)
        own_kv = seq_len // cp * kv_heads * head_dim * dtype.itemsize  # the rank's own K (or V) shard
        outputs = 2 * _nbytes(q) + _nbytes(lse) + 2 * own_kv  # out, dq; lse; the rank's own dk, dv
    return StepCount(comm, step.calls, fwd.tally, bwd.tally, outputs)


def random_documents(seq_len: int, count: int, seed: int = 0, within: Optional[Mask] = None) -> Mask:
    """A packed sequence of ``count`` documents at seeded random offsets (``--documents``), each ``within`` (default
    causal)."""
    import random

    from mcp_context.masks import documents_mask

    rng = random.Random(seed)
    return documents_mask([0, *sorted(rng.sample(range(1, seq_len), count - 1)), seq_len], within=within,
                          seq_len=seq_len)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--inner", type=int, default=2, help="all-to-all degree of the hierarchical schemes")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--documents", type=int, default=0,
                    help="a packed sequence of this many documents at seeded random offsets, balanced layout "
                         "(default 0: one sequence)")
    ap.add_argument("--window", type=window_pair, metavar="LEFT,RIGHT",
                    help="a sliding window (Megatron's window_size; causal where RIGHT is 0), in each document "
                         "with --documents (default: causal)")
    ap.add_argument("--layout", choices=("zigzag", "contiguous", "striped", "balanced"),
                    help="token layout (default: zigzag, balanced with --documents)")
    args = ap.parse_args(argv)
    mask = CAUSAL if args.window is None else attention_mask(args.window[1] == 0, args.window)
    if args.documents:
        mask = random_documents(args.seq_len, args.documents, within=mask)
    layout = args.layout or ("balanced" if args.documents else "zigzag")
    print(f"S={args.seq_len} P={args.cp} h={args.heads}/{args.kv_heads} d={args.head_dim}, rank {args.rank}, "
          f"cuDNN, bf16 (fake CUDA tensors), {layout}" + (f", window {args.window}" if args.window else "")
          + (f", {args.documents} packed documents" if args.documents else ""))
    print(f"{'scheme':16}{'calls':>6}{'ops fwd':>9}{'ops bwd':>9}{'ops':>6}{'MiB':>9}{'x outputs':>11}"
          f"{'host ops':>10}  ops by name")
    for comm in SCHEMES:
        c = count_step(comm, args.seq_len, args.cp, args.heads, args.kv_heads, args.head_dim, mask, args.inner,
                       args.rank, layout=layout)
        names = ", ".join(f"{n} {k}" for n, k in (c.forward.by_op + c.backward.by_op).most_common())
        print(f"{comm:16}{c.calls:>6}{c.forward.ops:>9}{c.backward.ops:>9}{c.ops:>6}{c.bytes / 2**20:>9.0f}"
              f"{c.bytes / c.output_bytes:>11.1f}{c.host_ops:>10}  {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
