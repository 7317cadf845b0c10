"""The engine across real CP ranks: shard the full-sequence data, run forward and backward, gather back.

Every rank holds the same seeded full-sequence inputs, shards them with ``shard_sequence`` (in the
layout the data is sliced in), calls ``ContextParallelAttention`` as a model layer would, and
all-gathers its outputs and gradients, which are put back in order with ``unshard_sequence`` in the
layout the engine was told. The sinks' gradient is each rank's share, summed over the CP ranks (what
Megatron's gradient all-reduce does). The same call, repeated, gives the bytes each rank sent by
operation (``trace.comm_stats``) and the time per call.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..comm import HCPGroups
from ..engine import ContextParallelAttention
from ..layouts import shard_sequence, unshard_sequence
from ..trace import comm_stats
from .faults import scale_on_rank, sink_on_rank, sliced_layout
from .setup import AttentionKind, Setup


class EngineRun:
    """One attention kind in one dtype on this CP rank: its shards, its engine, its call."""

    def __init__(self, setup: Setup, kind: AttentionKind, dtype: torch.dtype, data: dict, groups: HCPGroups,
                 fault: Optional[str] = None):
        self.setup, self.kind, self.groups, self.dtype = setup, kind, groups, dtype
        rank, cp = groups.cp_rank, groups.cp_size
        self.device = torch.device(setup.device)
        cu, padded = setup.documents if kind.packed else (None, None)
        self.cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=self.device)
        self.padded = None if padded is None else torch.tensor(padded, dtype=torch.int32, device=self.device)
        data_layout = sliced_layout(setup.layout, kind.packed, fault)
        self.shards = {name: shard_sequence(data[name], cp, rank, data_layout, 0, cu, padded).to(self.device, dtype)
                       for name in ("q", "k", "v", "dout")}
        sink_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        self.sink = None if data["sink"] is None else data["sink"].to(self.device, sink_dtype)
        self.sink = sink_on_rank(self.sink, rank, fault)
        self.engine = ContextParallelAttention(groups, causal=True, layout=setup.layout, comm=setup.comm,
                                               softmax_scale=scale_on_rank(setup.head_dim ** -0.5, rank, fault),
                                               window_size=kind.window)

    def call(self) -> dict:
        """Forward and backward once: this rank's ``out, lse, dq, dk, dv`` (and ``dsink``, its share)."""
        q, k, v = (self.shards[n].detach().requires_grad_() for n in ("q", "k", "v"))
        sink = None if self.sink is None else self.sink.detach().requires_grad_()
        out, lse = self.engine(q, k, v, return_lse=True, cu_seqlens=self.cu, cu_seqlens_padded=self.padded,
                               softmax_offset=sink)
        out.backward(self.shards["dout"])
        local = {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
        if sink is not None:
            local["dsink"] = sink.grad
        return local

    def gathered(self, local: dict) -> dict:
        """Every rank's outputs in full-sequence order (fp64, CPU), the sinks' gradient summed."""
        every = [dict() for _ in range(self.groups.cp_size)]
        for name, x in local.items():
            parts = [torch.empty_like(x) for _ in range(self.groups.cp_size)]
            dist.all_gather(parts, x.contiguous(), group=self.groups.cp_group)
            for rank, part in enumerate(parts):
                every[rank][name] = part
        return in_order(every, self.setup, self.kind)

    def measure(self, repeats: int) -> tuple[dict[str, int], list[float]]:
        """Bytes this rank sent by operation in one forward+backward, and the seconds of ``repeats`` calls
        (each after a barrier; on CUDA synchronised)."""
        comm_stats.reset()
        self.call()
        sent = dict(comm_stats.bytes_sent)
        times = []
        for _ in range(repeats):
            dist.barrier(group=self.groups.cp_group)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.call()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return sent, times


def in_order(every: list[dict], setup: Setup, kind: AttentionKind) -> dict:
    """Every rank's ``out, lse, dq, dk, dv`` (``every[r]``: CP rank r's) put back in full-sequence order
    in the layout the engine was told (fp64, CPU); the sinks' gradient summed over the ranks (what
    Megatron's gradient all-reduce does)."""
    cu, padded = (torch.tensor(x, dtype=torch.int32) for x in setup.documents) if kind.packed else (None, None)
    full = {}
    for name in every[0]:
        parts = [local[name].double().cpu() for local in every]
        full[name] = sum(parts) if name == "dsink" else unshard_sequence(parts, setup.layout, 0, cu, padded)
    return full


def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times) if times else float("nan")
