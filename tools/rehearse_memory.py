"""Estimate one rank's peak GPU memory for a ring step on a CPU-only torch (a rehearsal, not a measurement).

Under ``FakeTensorMode`` with ``device="cuda"`` every tensor has a size and no data, and
``torch.distributed._tools.mem_tracker.MemTracker`` adds up the storages alive at each op. One rank
(``--rank``, default 0) of a P-rank p2p zigzag ring runs ``ring_forward`` then ``ring_backward`` (called
directly: autograd aborts on fake CUDA tensors) through the real ``RingRotation``, whose exchanges are
replaced by ``NoWireExchange``: a transfer allocates its receive buffer and keeps the send buffer alive
until it is waited on, as ``RingExchange`` does, and sends nothing. Against it: one fused causal call of
the same op with the same useful work (``n`` rows with ``n^2 / 2`` visible pairs equal to the rank's),
forward and backward.

What the estimate leaves out: kernel workspaces (cuDNN's, flash's), NCCL buffers, the caching
allocator's rounding and fragmentation, and the compiled merge (a rehearsal merges eagerly, whose
temporaries are counted; ``--idle-regions``: the regions do nothing and allocate nothing, as compiled on a GPU,
and the peaks are the same). Against an H200 (run 5,
``docs/performance.md``): rank 0's step at 32K and 128K over 8 ranks measured 0.63 of the fused call where
this gives 0.81, so it errs high.

    python tools/rehearse_memory.py --seq-len 32768 131072 --cp 8 --backend torch:cudnn
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcp_context.algorithms.executor import ring_backward, ring_forward  # noqa: E402
from mcp_context.kernels import get_kernel  # noqa: E402
from mcp_context.masks import CAUSAL, CAUSAL_BLOCK  # noqa: E402
from tools.rank_step import rank_step, regions_doing_nothing  # noqa: E402

CUDA = torch.device("cuda")
MIB = 2 ** 20


def rank_step_peak(seq_len: int, cp: int, rank: int, heads: int, kv_heads: int, head_dim: int,
                   backend: str) -> dict:
    """Peak MiB of one rank's forward+backward and of one fused call of equal useful work."""
    dtype = torch.bfloat16
    with FakeTensorMode():
        kernel = get_kernel(backend, CUDA, dtype, head_dim=head_dim)
        step = rank_step("p2p", cp, seq_len, CAUSAL, kernel, heads, kv_heads, head_dim, rank=rank)
        rows = step.q_rows
        n = int(round(math.sqrt(2 * step.useful_pairs)))

        def ring_step() -> None:
            plan, kv_rows = step.walked()
            q, dout = (torch.empty(rows, 1, heads, head_dim, device=CUDA, dtype=dtype) for _ in range(2))
            k, v = (torch.empty(kv_rows, 1, kv_heads, head_dim, device=CUDA, dtype=dtype) for _ in range(2))
            out, lse = ring_forward(q, k, v, plan)
            ring_backward(dout, q, k, v, out, lse, plan)

        def fused_call() -> None:
            q, dout = (torch.empty(1, heads, n, head_dim, device=CUDA, dtype=dtype) for _ in range(2))
            k, v = (torch.empty(1, kv_heads, n, head_dim, device=CUDA, dtype=dtype) for _ in range(2))
            out, lse = kernel.forward(q, k, v, CAUSAL_BLOCK, head_dim ** -0.5)
            kernel.backward(dout, q, k, v, out, lse, CAUSAL_BLOCK, head_dim ** -0.5)

        ring, fused = _peak(ring_step), _peak(fused_call)
    return {"seq_len": seq_len, "cp": cp, "rank": rank, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": "bfloat16", "backend": kernel.name, "rank_rows": rows, "fused_rows": n,
            "rank_peak_mib": round(ring, 1), "fused_peak_mib": round(fused, 1), "ratio": round(ring / fused, 3)}


def _peak(run) -> float:
    tracker = MemTracker()
    with tracker:
        run()
    snap = tracker.get_tracker_snapshot("peak")
    return sum(kinds["Total"] for dev, kinds in snap.items() if dev.type == "cuda") / MIB


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--backend", default="torch:cudnn", help="torch:cudnn or torch:flash (default torch:cudnn)")
    ap.add_argument("--idle-regions", action="store_true",
                    help="the fused regions do nothing, so allocate nothing, as compiled on a GPU (default: their "
                         "eager form runs and its temporaries count)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    for seq_len in args.seq_len:
        with regions_doing_nothing() if args.idle_regions else contextlib.nullcontext():
            row = rank_step_peak(seq_len, args.cp, args.rank, args.heads, args.kv_heads, args.head_dim, args.backend)
        print(json.dumps(dict(row, idle_regions=args.idle_regions)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
