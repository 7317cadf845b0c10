"""A rank's attention step replayed from CUDA graphs: the host issues one launch where it issued the step.

On an H200 a short step is bound by the host, not the GPU (docs/performance.md, "Why the short cells fall
short"): at 32K over 64 ranks issuing a rank's fwd+bwd took the host 3.7-4.0 ms beside 1.4-2.0 ms of GPU
work, and the 32K/P8 ring 7.75 ms beside 8.0 ms. The plan is static per shard shape and the step makes
no host-device synchronisation, so it can be captured once and replayed: ``StepGraphs`` is a
``executor.StepRunner`` that, per input signature (shapes, dtypes, device, sink), captures
``ring_forward`` and ``ring_backward`` over static input buffers the first time and then, per call,
copies the inputs in, replays, and clones the outputs out.

- **Inputs are copied in, outputs cloned out**, so one graph serves every layer that shares the engine
  (``api.engine_for``) and no result aliases memory the next replay overwrites. K and V that are the
  columns of one packed tensor (what a collective hands on) get static buffers of the same shape, so the
  captured step takes the same no-copy paths; dK and dV come back as the columns of one buffer likewise.
  The copies are memory-bound and small beside the step (forward: q, k, v in, out and lse out; backward:
  dout, q, k, v, out, lse in, dq, dk, dv out: about 1.5 % of the 32K/P8 ring's step and 3 % of 32K/P64's
  one-head a2a step at an H200's bandwidth, estimated from the bytes, not measured).
- **One memory pool per runner** serves all its graphs: everything a replay allocates is dead once its
  outputs are cloned, and replays run one after another on the caller's stream.
- **Captured in order**: the work after each call runs on the calls' stream (``streams.inline``); the
  side stream overlapped the host's issue with the GPU, which a replay does not need.
- **What is not captured is refused when the engine is built or the scheme resolved** (``refusal``): a
  rotation whose transfers cross processes inside the step (the p2p rings and halos: NCCL can capture
  point-to-point operations, but one GPU cannot run two ranks to check it, ``rotation.Rotation.captures``),
  attention dropout (a mask drawn per call), and devices other than CUDA. The all-to-alls and all-gathers
  of ``a2a``, ``all_gather`` and ``a2a+all_gather`` run outside the step, eagerly, as before.

Capturing costs a warm-up step, a device synchronisation and the capture itself, once per signature; a
signature's graphs and buffers live as long as the runner (the engine's scheme for that shard shape).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from . import streams
from .executor import RingPlan, ring_backward, ring_forward
from .packing import packed_columns, split_kv


def refusal(plan: RingPlan, device: torch.device) -> Optional[str]:
    """Why ``plan``'s step cannot be replayed from a CUDA graph on ``device``, or None when it can."""
    if device.type != "cuda":
        return f"CUDA graphs replay on a CUDA device, and the shards are on {device.type}"
    if not plan.rotation.captures:
        return ("this scheme moves K/V between ranks inside the step (a p2p ring or halo), whose transfers are not "
                "captured; use a scheme whose K/V are local to the step (comm a2a, all_gather or a2a+all_gather)")
    if plan.dropout_p > 0:
        return f"attention dropout ({plan.dropout_p}) draws a new mask per call; use dropout 0"
    return None


def _map_packed(xs: tuple[Optional[torch.Tensor], ...], one: Callable[[torch.Tensor], torch.Tensor],
                whole: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
    """``one(x)`` for each tensor of ``xs`` (None stays None), except that two neighbours that are the columns
    of one packed tensor (K and V, dK and dV: ``packing.packed_columns``) become the same columns of
    ``whole(packed)``."""
    out: list[Optional[torch.Tensor]] = []
    i = 0
    while i < len(xs):
        x, y = xs[i], xs[i + 1] if i + 1 < len(xs) else None
        pair = packed_columns(x, y) if x is not None and y is not None else None
        if pair is not None:
            out.extend(split_kv(whole(pair), x.shape[-1]))
            i += 2
        else:
            out.append(None if x is None else one(x))
            i += 1
    return tuple(out)


def _static_like(*xs: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
    """Buffers like ``xs``, strides kept where dense, a packed K/V pair packed (``_map_packed``)."""
    return _map_packed(xs, lambda x: torch.empty_like(x, memory_format=torch.preserve_format), torch.empty_like)


def _cloned(*xs: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
    """Copies of a replay's outputs that the next replay cannot overwrite, a packed dK/dV pair packed."""
    return _map_packed(xs, lambda x: x.clone(memory_format=torch.preserve_format), torch.clone)


def _signature(*xs: Optional[torch.Tensor]) -> tuple:
    return tuple(None if x is None else (tuple(x.shape), x.dtype, x.device, packed_columns(x, y) is not None
                                         if y is not None else False)
                 for x, y in zip(xs, (*xs[1:], None)))


Capture = Callable[[Callable[..., tuple], tuple], tuple[Callable[[], None], tuple]]
"""``capture(run, static) -> (replay, outputs)``: run ``run(*static)`` once so that ``replay()`` recomputes it on
the same buffers, writing the same ``outputs``. ``StepGraphs`` uses CUDA graphs; the CPU tests give a
capture that reruns ``run`` and copies into the first outputs (what a replay does to memory), which checks
the runner's own bookkeeping (copies in, clones out, one capture per signature), not CUDA's capture."""


@dataclass
class _Captured:
    """One captured step: its static inputs, the replay, and the static outputs a replay writes."""

    inputs: tuple[Optional[torch.Tensor], ...]
    replay: Callable[[], None]
    outputs: tuple[Optional[torch.Tensor], ...]

    def __call__(self, *xs: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        for static, x in zip(self.inputs, xs):
            if static is not None:
                torch.ops.aten.copy_(static, x)  # not Tensor.copy_: see executor._copy_
        self.replay()
        return _cloned(*self.outputs)


class StepGraphs:
    """``ring_forward``/``ring_backward`` replayed from CUDA graphs, captured once per input signature (see
    the module's docstring). ``capture``: how a step is captured (``Capture``; default CUDA graphs).
    ``captures`` counts the steps captured (a test reads it)."""

    def __init__(self, capture: Optional[Capture] = None) -> None:
        self.capture = self._cuda_graph if capture is None else capture
        self.pool = None
        self.graphs: dict[tuple, _Captured] = {}
        self.captures = 0

    def _cuda_graph(self, run: Callable[..., tuple], static: tuple) -> tuple[Callable[[], None], tuple]:
        """Warm ``run`` up on a side stream (it compiles the fused regions, builds cuDNN's plans, fills the
        caches), then capture it into a graph drawing on this runner's memory pool, the work in order."""
        first = next(x for x in static if x is not None)
        if not first.is_cuda or is_fake(first):
            raise ValueError(f"a step replayed from CUDA graphs (step_graphs=True) needs real CUDA tensors, got "
                             f"{'fake ' if is_fake(first) else ''}{first.device.type} tensors; build the engine with "
                             f"step_graphs=False for this device")
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with streams.inline():
            warm = torch.cuda.Stream(first.device)
            warm.wait_stream(torch.cuda.current_stream(first.device))
            with torch.cuda.stream(warm):
                run(*static)
            torch.cuda.current_stream(first.device).wait_stream(warm)
            # thread_local: a data loader's thread copying a batch to the GPU while a new shape captures (mid
            # training) must not invalidate the capture, as the default "global" mode would have it
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                outputs = run(*static)
        return graph.replay, tuple(outputs)

    def _replay(self, kind: str, run: Callable[..., tuple], xs: tuple[Optional[torch.Tensor], ...]) -> tuple:
        key = (kind, *_signature(*xs))
        captured = self.graphs.get(key)
        if captured is None:
            static = _static_like(*xs)
            for s, x in zip(static, xs):
                if s is not None:
                    torch.ops.aten.copy_(s, x)
            captured = self.graphs[key] = _Captured(static, *self.capture(run, static))
            self.captures += 1
        return captured(*xs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan,
                sink: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = self._replay("forward", lambda q, k, v, s: ring_forward(q, k, v, plan, s), (q, k, v, sink))
        return out, lse

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, plan: RingPlan, sink: Optional[torch.Tensor]) -> tuple:
        return self._replay("backward", lambda d, q, k, v, o, l, s: ring_backward(d, q, k, v, o, l, plan, s),
                            (dout, q, k, v, out, lse, sink))
