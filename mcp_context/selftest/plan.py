"""The plan: what every rank must agree on, which kernel runs, how many bytes a rank sends.

- ``agreement``: the ranks' ``Setup.fingerprint`` (sizes, comm, layout, sequence, heads, kinds,
  dtypes, packing), compared before anything collective runs; a disagreement is named rank by rank.
- ``kernels``: the kernel ``auto`` picks per dtype on this device and every backend's verdict with the
  probe's reason (``kernels.kernel_report``).
- ``analytic_bytes``: what one rank sends in one forward+backward, by operation, worked out from the
  scheme's definition (the same figures ``tests/test_comm_bytes.py`` holds the comm layer to), for a
  plain causal mask. A window or packed documents make the ring skip steps and send only the rows read
  (the halo), so for them the plain figure is an upper bound.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..cp_rules import a2a_degree, comm_rule
from ..kernels import accum_dtype
from .setup import AttentionKind, Setup


def disagreements(fingerprints: list[dict]) -> list[str]:
    """``"rank r: key=value (rank 0: value)"`` for every field where a rank differs from rank 0."""
    first = fingerprints[0]
    return [f"rank {r}: {key}={fp.get(key)!r} (rank 0: {first.get(key)!r})"
            for r, fp in enumerate(fingerprints) for key in sorted(set(first) | set(fp))
            if fp.get(key) != first.get(key)]


def kernels(setup: Setup) -> list[dict]:
    """``kernel_report`` for each dtype of the setup on its device (the probe's reasons included)."""
    from ..kernels.registry import kernel_report

    device = torch.device(setup.device)
    return [kernel_report(device, dtype, setup.head_dim, setup.v_head_dim) for dtype in setup.dtypes]


def analytic_bytes(setup: Setup, dtype: torch.dtype) -> dict[str, int]:
    """Bytes one CP rank sends by operation in one forward+backward of a plain causal layer (the call
    returns the lse too: under all-to-all that is one more fp32 ``[s, b, h]`` exchange)."""
    cp, inner = setup.cp_size, a2a_degree(setup.comm, setup.sizes)
    ring, n, b = cp // inner, setup.seq_len // cp, setup.batch
    h, kv, dqk, dv = setup.heads, setup.kv_heads, setup.head_dim, setup.v_head_dim
    es = torch.empty((), dtype=dtype).element_size()
    acc = torch.empty((), dtype=accum_dtype(dtype)).element_size()
    sent: dict[str, int] = {}
    kv_heads = kv
    if inner > 1:
        kv_heads = max(kv, inner)  # fewer KV heads than ranks: each is replicated before the all-to-all
        per_token = (h * dqk + h * dv + kv_heads * dqk + kv_heads * dv) * 2 * es  # fwd q,k,v,out; bwd dout,dq,dk,dv
        sent["all_to_all"] = (inner - 1) * n * b * per_token // inner + (inner - 1) * n * b * h * acc // inner
    if ring > 1 and comm_rule(setup.comm).kv == "gather":  # K/V all-gathered over the ring's members once
        block = inner * n * b * (kv_heads // inner) * (dqk + dv) * es
        sent["all_gather"] = (ring - 1) * block
        sent["reduce_scatter"] = (ring - 1) * block
    elif ring > 1:
        block = inner * n * b * (kv_heads // inner) * (dqk + dv)
        sent["ring_kv"] = 2 * (ring - 1) * block * es
        sent["ring_dkv"] = ring * block * acc
    return sent


def is_plain(kind: AttentionKind) -> bool:
    """A mask whose ring walks every step and sends whole shards (the analytic figure is exact)."""
    return kind.window is None and not kind.packed


def bytes_verdict(kind: AttentionKind, sent: list[dict[str, int]], expected: dict[str, int]) -> list[str]:
    """What is wrong with the ranks' counted bytes: not the figure (plain), above it (window, packed)."""
    problems = []
    for rank, counted in enumerate(sent):
        if is_plain(kind) and counted != expected:
            problems.append(f"rank {rank} sent {counted}, the analytic figure is {expected}")
        elif not is_plain(kind) and sum(counted.values()) > sum(expected.values()):
            problems.append(f"rank {rank} sent {sum(counted.values())} bytes, more than a full ring's "
                            f"{sum(expected.values())}")
    return problems


def dry_run_bytes(setup: Setup, kind: AttentionKind, mask, dtype: torch.dtype, cp_rank: int = 0
                  ) -> Optional[dict[str, int]]:
    """Bytes CP rank ``cp_rank`` sends, counted by the trace in the planner's dry run (the engine's own
    code on meta tensors in a fake world); None where the dry run cannot model it (MLA head dims)."""
    if setup.v_head_dim != setup.head_dim:
        return None
    from ..plan.dryrun import RankShape, dry_run_rank

    shape = RankShape(setup.seq_len, setup.batch, setup.heads, setup.kv_heads, setup.head_dim, dtype)
    traffic = dry_run_rank(setup.comm, setup.sizes, setup.layout, mask, shape, cp_rank)
    total = dict(traffic.forward)
    for op, nbytes in traffic.backward.items():
        total[op] = total.get(op, 0) + nbytes
    if "all_to_all" in total:  # the dry run asks for no lse; the check's call does
        inner = a2a_degree(setup.comm, setup.sizes)
        acc = torch.empty((), dtype=accum_dtype(dtype)).element_size()
        total["all_to_all"] += (inner - 1) * (setup.seq_len // setup.cp_size) * setup.batch * setup.heads * acc // inner
    return total
