"""Device part of ``tools/bench_attention.py``: block kernels side by side, and one rank's step of each
scheme on one device (a ring walked as its member walks it, the other kinds over the K/V their collectives
deliver, laid out locally: ``tools/rank_step.py``; on a GPU also with the other choice of where the work after
each call runs (on the side stream where the step ships it in order, ``streams.SIDE_STREAM_MIN_FLOPS``, in order
where it ships it there): ``side_stream_gain`` is the in-order time over the side stream's, whichever ships
(``side_stream_ships``); and with the host ahead of the GPU, as in training,
where the layers before it keep the GPU's queue full: ``queued_efficiency``, the side stream's gain there
(``queued_side_stream_gain``), the host's issue time and the host-device synchronisations one step makes;
and replayed from CUDA graphs, ``graphed_efficiency``: ``algorithms/graphs.py``, which the engine uses in
training only where no transfer runs inside the step, ``graphs_in_training``) against two fused
baselines: one SDPA call of equal useful FLOPs (ours, the strict one), and one at the per-rank length
``S / P`` (ring-flash-attention's, so our figures sit beside published ones). The transfers a scheme
needs are not run on one GPU: their bytes and the time they take at stated link rates (``LINKS_GBPS``)
are reported beside the compute.

CUDA events and ``torch.cuda.max_memory_allocated`` on a GPU; ``perf_counter`` (and no peak memory) on
the CPU, where it is a smoke run of the path, not a figure.

Every result goes to ``sink`` as soon as it is measured (``append_jsonl`` writes one flushed JSON line),
so a run that dies later keeps what it measured. The math kernel materialises O(s^2) fp32 scores: its
micro-benchmark runs only while ``math_block_bytes`` fits in half the device's memory (at 32 query
heads that is up to S/P of about 7.9K rows on an 80 GB H100; it ran out of memory at ~12K), and an
out-of-memory error in any measurement is recorded as that row's result instead of ending the run.
"""
from __future__ import annotations

import functools
import json
import math
import os
import statistics
import time
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from mcp_context.plan.cost import FWD_BWD_FLOP_FACTOR
from tools.bench_cpu import Shape


def _once(fn, device: torch.device) -> float:
    """Seconds of one call of ``fn`` (CUDA events on a GPU)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def _interleaved_seconds(fns: dict, device: torch.device, reps: int) -> dict[str, list[float]]:
    """Times of every function in ``fns``, one call of each per repetition, after one warm-up each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_once(fn, device))
    return times


@functools.lru_cache(maxsize=None)
def _sleep_cycles_per_second(device: torch.device) -> float:
    """How fast ``torch.cuda._sleep`` spins on this GPU (cycles per second), timed once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize(device)
    return 10_000_000 / (start.elapsed_time(end) / 1e3)


def _queued_once(fn, device: torch.device, hold_cycles: int) -> tuple[float, float, bool]:
    """One call of ``fn`` with the GPU held busy (``torch.cuda._sleep``) while the host issues its work, as in
    a training step, where the layers before it keep the GPU's queue full: ``(GPU seconds from the end of the
    hold to the end of fn's work, host seconds fn took to issue it, whether the hold outlasted the issue)``.
    When it did, the GPU never waited for the host and the first figure is the work's own GPU time."""
    held, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda.synchronize(device)
    held.record()
    torch.cuda._sleep(hold_cycles)
    start.record()
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3, host, host < held.elapsed_time(start) / 1e3


def _queued_seconds(fns: dict, device: torch.device, reps: int, cold_s: float) -> dict[str, list[tuple]]:
    """``_queued_once`` of every function in ``fns``, one call of each per repetition, each held twice ``cold_s``
    (the step's cold time) + 2 ms: longer than the host takes to issue the step unless it is badly host-bound
    (then the hold does not outlast the issue, and ``_queued_once`` says so). The cold time + 2 ms was not
    always enough on an H200 (run 3)."""
    cycles = int((2 * cold_s + 2e-3) * _sleep_cycles_per_second(device))
    times: dict[str, list[tuple]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_queued_once(fn, device, cycles))
    return times


def _host_syncs(fn) -> list[str]:
    """The host-device synchronisations one call of ``fn`` makes (``torch.cuda.set_sync_debug_mode``): a
    step that waits for the GPU cannot run ahead of it."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(before)
    return [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]


def _peak_bytes(fn, device: torch.device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) - base


def _device_kernels(device: torch.device, dtype: torch.dtype, head_dim: int) -> dict:
    """Every block kernel the registry knows: name -> kernel, or the probe's reason it does not serve."""
    from mcp_context.kernels import BACKENDS, probe

    named = [b for b in BACKENDS if b not in ("auto", "torch")]
    return {name: v.kernel if (v := probe(name, device, dtype, head_dim=head_dim)).kernel is not None else v.reason
            for name in named}


MATH_SCORE_COPIES = 5
"""fp32 ``[b, h, s, s]`` tensors the math kernel's backward holds at once (scores, their masked copy,
probabilities, dP, dS)."""


def math_block_bytes(batch: int, heads: int, rows: int) -> int:
    """Bytes the math kernel's forward+backward of one causal ``rows x rows`` block needs at its peak."""
    return MATH_SCORE_COPIES * 4 * batch * heads * rows * rows


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of ``device`` (the GPU's, or the machine's RAM for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def append_jsonl(path: str) -> Callable[[dict], None]:
    """A sink that appends each record to ``path`` as one JSON line, flushed to disk before returning."""
    def write(record: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
    return write


def _out_of_memory(err: BaseException) -> Optional[str]:
    """The row's result when ``err`` is the device running out of memory, else None."""
    if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower():
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return f"out of memory: {str(err).splitlines()[0][:200]}"
    return None


def _kernel_block(kernel, q, k, v, dout, backward: bool):
    from mcp_context.masks import CAUSAL_BLOCK

    out, lse = kernel.forward(q, k, v, CAUSAL_BLOCK, q.shape[-1] ** -0.5)
    if backward:
        kernel.backward(dout, q, k, v, out, lse, CAUSAL_BLOCK, q.shape[-1] ** -0.5)


def device_benchmarks(device: torch.device, shape: Shape, world_sizes, reps: int,
                      sink: Callable[[dict], None] = lambda record: None,
                      math_budget_bytes: Optional[int] = None, schemes=("p2p",)) -> dict:
    """Kernel backends side by side, and one rank's schedule vs one fused SDPA of equal useful FLOPs.

    Each kernel row and each schedule row goes to ``sink`` as it is measured (with ``part`` and
    ``seq_len``). The math kernel is skipped, with the reason, when ``math_block_bytes`` exceeds
    ``math_budget_bytes`` (default: half of ``device_memory_bytes``)."""
    from mcp_context.kernels import get_kernel

    print(f"  S={shape.seq_len}", flush=True)

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, hk, d = shape.batch, shape.heads, shape.kv_heads, shape.head_dim
    n = shape.seq_len // max(world_sizes)
    gen = torch.Generator().manual_seed(2)
    budget = device_memory_bytes(device) // 2 if math_budget_bytes is None else math_budget_bytes

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device, dtype)

    def emit(part: str, row: dict) -> None:
        sink({"part": part, "device": str(device), "seq_len": shape.seq_len, "block_len": n, **row})

    q, k, v, dout = rand(b, h, n, d), rand(b, hk, n, d), rand(b, hk, n, d), rand(b, h, n, d)
    causal_flops = 4 * b * h * d * n * (n + 1) // 2
    kernels = []
    for name, kern in _device_kernels(device, dtype, d).items():
        row = {"kernel": name}
        if isinstance(kern, str):
            row["unavailable"] = kern
        elif name == "math" and math_block_bytes(b, h, n) > budget:
            row["skipped"] = (f"needs ~{math_block_bytes(b, h, n) / 2**30:.1f} GiB ({MATH_SCORE_COPIES} fp32 "
                              f"[{b}, {h}, {n}, {n}] score tensors), over the bound of {budget / 2**30:.1f} GiB "
                              f"(half the device's memory)")
        else:
            calls = {label: (lambda backward=backward: _kernel_block(kern, q, k, v, dout, backward))
                     for label, backward in (("fwd", False), ("fwd_bwd", True))}
            try:
                times = _interleaved_seconds(calls, device, reps)
                for label, flops in (("fwd", causal_flops), ("fwd_bwd", causal_flops * FWD_BWD_FLOP_FACTOR)):
                    row[f"{label}_s"] = times[label]
                    row[f"{label}_tflops"] = flops / statistics.median(row[f"{label}_s"]) / 1e12
                    row[f"{label}_peak_bytes"] = _peak_bytes(calls[label], device)
            except RuntimeError as err:
                if (reason := _out_of_memory(err)) is None:
                    raise
                row = {"kernel": name, "error": reason}
        kernels.append(row)
        emit("kernel", row)

    kernel = get_kernel("auto", device, dtype, head_dim=d)
    schedules = []
    for world in world_sizes:
        for comm in schemes:
            row = {"world_size": world, "comm": comm, "rank": 0, "kernel": kernel.name}
            try:
                schedule_row(row, device, kernel, rand, shape, reps)
            except RuntimeError as err:
                if (reason := _out_of_memory(err)) is None:
                    raise
                row["error"] = reason
            schedules.append(row)
            emit("rank_schedule", row)
    return {"device": str(device), "dtype": str(dtype), "seq_len": shape.seq_len, "block_len": n, "kernels": kernels,
            "rank_schedule": schedules}


LINKS_GBPS = {"nvlink": 450.0, "network": 50.0}
"""Link rates (GB/s per GPU per direction) at which a scheme's transfers are modelled: NVLink inside a
node of 8, the network between nodes."""


def _equal_len(pairs: int) -> int:
    """The causal length whose ``s (s + 1) / 2`` pairs equal ``pairs``."""
    return round((math.sqrt(8 * pairs + 1) - 1) / 2)


def fused_call(n: int, rand: Callable[..., torch.Tensor], heads: int, kv_heads: int, head_dim: int, batch: int = 1
               ) -> Callable[[bool], None]:
    """``call(backward=True)``: one causal SDPA call over ``n`` rows (``[batch, heads, n, head_dim]`` queries drawn by
    ``rand``, then keys, values and the output gradient) and its backward through autograd, gradients accumulating
    into its leaves as the rank step's do: the fused baseline of the benchmark and of ``tools/host_costs.py``."""
    q, k, v = (rand(batch, hh, n, head_dim).requires_grad_() for hh in (heads, kv_heads, kv_heads))
    dout = rand(batch, heads, n, head_dim)

    def call(backward: bool = True) -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
        if backward:
            out.backward(dout)
    return call


def schedule_row(row: dict, device, kernel, rand, shape: Shape, reps: int, inner: Optional[int] = None) -> None:
    """Fill ``row`` with rank 0's step of ``row["comm"]`` against two fused baselines: one SDPA call of
    equal useful FLOPs (ours) and one at the per-rank length ``S / P`` (ring-flash-attention's). ``inner``:
    the all-to-all degree of a hierarchical scheme (default 2 for an even P)."""
    from mcp_context.algorithms import streams
    from mcp_context.algorithms.calls import gpu_of
    from mcp_context.masks import CAUSAL
    from tools.rank_step import captured_call, harness, rank_step, transfer_bytes, walked_call

    b, h, hk, d = shape.batch, shape.heads, shape.kv_heads, shape.head_dim
    world, comm = row["world_size"], row["comm"]
    inner = (2 if world % 2 == 0 else 1) if inner is None else inner
    step = rank_step(comm, world, shape.seq_len, CAUSAL, kernel, h, hk, d, inner)
    pairs = step.useful_pairs
    s_eq, s_rank = _equal_len(pairs * step.heads // h), shape.seq_len // world
    row.update(sizes=list(step.sizes), heads_on_rank=step.heads, attention_calls=step.calls_on(gpu_of(rand(1))),
               useful_pairs=pairs,
               equal_flops_causal_len=s_eq, per_rank_len=s_rank, harness=harness())
    rank_step_call = walked_call(step, rand, d, b)  # a ring as its member walks it: its own K/V, its messages
    if device.type == "cuda":  # the same step replayed from CUDA graphs (step_graphs): the host issues one launch
        graphed_call, error = captured_call(step, rand, d, b)
        if error is not None:
            row["graphed_error"] = error
            print(f"  P={world} {comm}: the graphed step failed ({error}); timed without it", flush=True)

        def graphed_from_scratch():  # its peak memory: a fresh runner's capture and first replay, the leaves'
            fresh, _ = captured_call(step, rand, d, b)  # gradients made too (an upper bound)
            fresh()
    lengths = {"fused": s_eq, "fused_per_rank": s_rank}
    baselines = {name: fused_call(n, rand, h, hk, d, b) for name, n in lengths.items()}

    side = streams.side_stream_pays(step.plan.call_flops(b * step.heads, d, d))  # what the step ships

    def other_streams(backward):  # the same step with the other choice: in order where the side stream ships
        with streams.inline() if side else streams.everywhere():
            rank_step_call(backward)

    def by_stream(ours, other):
        """``(in order, side stream)`` of the step's two stream choices (their times, or their calls)."""
        return (other, ours) if side else (ours, other)

    sent = transfer_bytes(comm, world, shape.seq_len, h, hk, d, inner)
    for label, backward, factor in (("fwd", False, 1.0), ("fwd_bwd", True, FWD_BWD_FLOP_FACTOR)):
        flops = 4 * b * step.heads * d * pairs * factor
        calls = {"ours": lambda backward=backward: rank_step_call(backward),
                 "fused": lambda backward=backward: baselines["fused"](backward),
                 "fused_per_rank": lambda backward=backward: baselines["fused_per_rank"](backward)}
        if device.type == "cuda":  # elsewhere the step runs in order anyway, and nothing replays a graph
            calls["other_streams"] = lambda backward=backward: other_streams(backward)
            if "graphed_error" not in row:
                calls["graphed"] = lambda backward=backward: graphed_call(backward)
        t = _interleaved_seconds(calls, device, reps)
        base_flops = {name: 4 * b * h * d * n * (n + 1) // 2 * factor for name, n in lengths.items()}
        res = {"ours_s": t["ours"], "ours_tflops": flops / statistics.median(t["ours"]) / 1e12}
        if "other_streams" in t:
            in_order_t, side_t = by_stream(t["ours"], t["other_streams"])
            res.update(side_stream_ships=side, in_order_s=in_order_t, side_stream_s=side_t,
                       side_stream_gain=statistics.median(i / a for i, a in zip(in_order_t, side_t)))
            # the same step with the host ahead of the GPU, as in training (host_ahead False where the host
            # still fell behind); the other choice too, to tell whether the side stream pays where the host is not
            # the limit
            queued = _queued_seconds({name: calls[name] for name in ("ours", "fused", "other_streams")}, device,
                                     reps, statistics.median(t["ours"]))
            qa, qf, qo = ([g for g, _, _ in queued[name]] for name in ("ours", "fused", "other_streams"))
            qi, qs = by_stream(qa, qo)
            res.update(queued_s=qa, queued_fused_s=qf, queued_in_order_s=qi, queued_side_stream_s=qs,
                       queued_efficiency=statistics.median(flops / a / (base_flops["fused"] / f) for a, f in zip(qa, qf)),
                       queued_side_stream_gain=statistics.median(i / a for i, a in zip(qi, qs)),
                       host_issue_s=[h for _, h, _ in queued["ours"]],
                       fused_host_issue_s=[h for _, h, _ in queued["fused"]],  # the floor: one call and its backward
                       host_ahead=all(ok for _, _, ok in queued["ours"] + queued["fused"]),
                       host_syncs=_host_syncs(calls["ours"]))
        if "graphed" in t:  # in training only where no transfer runs inside the step (graphs_in_training)
            res.update(graphed_s=t["graphed"], graphs_in_training=step.graphs_in_training,
                       graphed_efficiency=statistics.median(flops / a / (base_flops["fused"] / f)
                                                            for a, f in zip(t["graphed"], t["fused"])))
            if backward:  # a fresh capture costs a warm-up step and a device synchronisation: fwd+bwd only
                res["graphed_peak_bytes"] = _peak_bytes(graphed_from_scratch, device)
        for name in ("fused", "fused_per_rank"):
            res[f"{name}_s"] = t[name]
            res[f"{name}_tflops"] = base_flops[name] / statistics.median(t[name]) / 1e12
            ratio = statistics.median(flops / a / (base_flops[name] / f) for a, f in zip(t["ours"], t[name]))
            res["efficiency" if name == "fused" else "efficiency_vs_per_rank"] = ratio
        nbytes = sent["forward"] if label == "fwd" else sent["forward"] + sent["backward"]
        res["bytes_sent"] = nbytes
        res["modelled_transfer_s"] = {link: nbytes / (rate * 1e9) for link, rate in LINKS_GBPS.items()}
        res["ours_peak_bytes"] = _peak_bytes(calls["ours"], device)
        res["fused_peak_bytes"] = _peak_bytes(calls["fused"], device)
        if "other_streams" in calls:  # what holding a call's output until the side stream has read it costs
            in_order_call, _ = by_stream(calls["ours"], calls["other_streams"])
            res["in_order_peak_bytes"] = _peak_bytes(in_order_call, device)
        if res["fused_peak_bytes"]:
            res["memory_ratio"] = res["ours_peak_bytes"] / res["fused_peak_bytes"]
        row[label] = res
        print(f"  P={world} {comm:15} {label:8}: {res['ours_tflops']:5.0f} TFLOP/s, {res['efficiency']:.2f} of fused "
              f"({res['fused_tflops']:.0f}), {res['efficiency_vs_per_rank']:.2f} of fused at S/P "
              f"({res['fused_per_rank_tflops']:.0f}); "
              + (f"side stream x{res['side_stream_gain']:.3f} (host ahead x{res['queued_side_stream_gain']:.3f}); "
                 f"host ahead {res['queued_efficiency']:.2f} of fused "
                 f"(issue {statistics.median(res['host_issue_s']) * 1e3:.2f} ms, fused "
                 f"{statistics.median(res['fused_host_issue_s']) * 1e3:.2f} ms, "
                 f"{len(res['host_syncs'])} syncs); " if "side_stream_gain" in res else "")
              + (f"graphed {res['graphed_efficiency']:.2f} of fused; " if "graphed_efficiency" in res else "")
              + f"{row['attention_calls']:g} calls; transfers "
              f"{nbytes / 2**20:.0f} MiB = {res['modelled_transfer_s']['nvlink'] * 1e3:.2f} ms NVLink, "
              f"{res['modelled_transfer_s']['network'] * 1e3:.2f} ms network", flush=True)
