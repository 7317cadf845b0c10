"""Where the work after each attention call runs: on a CUDA device, where the calls are long, on a second
stream, so the merges and dQ sums of one call run while the next call computes (TransformerEngine's ring
overlaps its corrections the same way); where they are short (``SIDE_STREAM_MIN_FLOPS``), and anywhere else
(CPU, fake tensors), in order, as written.

The rules that keep the overlap exact, all kept here and in ``executor``:

- the side stream waits for the main stream before it reads a call's outputs (``SideStream.after``);
- every tensor the side stream reads or writes is allocated on the main stream (the executor makes its
  result and accumulator buffers before it enters ``after``), and each call output it reads is marked as
  used there (``record_stream``), so the caching allocator never hands that memory to the main stream's
  next call while the side stream still reads it;
- the main stream waits for the side stream before anything reads the results (``join``). The dK/dV sums
  stay on the main stream: a ring sends them on at its next step.
"""
from __future__ import annotations

import contextlib
import functools
from typing import ContextManager, Iterator, Union

import torch
from torch._subclasses.fake_tensor import is_fake

from ..switches import setting

_enabled = True
_everywhere = False
SIDE_STREAM_ENV = "MCP_CONTEXT_SIDE_STREAM"
"""``0`` runs the work after each call in order on the calls' own stream (the same results; for comparing,
or if the overlap misbehaves on a machine); ``1``: the side stream on CUDA for every call; unset: for calls
of ``SIDE_STREAM_MIN_FLOPS`` or more."""

SIDE_STREAM_MIN_FLOPS = 1e12
"""The forward FLOPs a step's attention calls must average for their work to go on the side stream when
``MCP_CONTEXT_SIDE_STREAM`` is unset. The side stream adds host work to every call (a wait, a mark per output,
two stream switches); where calls are short the host issues a step slower than the GPU runs it, and that work
is the step's time. On an H200 (run 5, ``docs/gpu/h200_run5_bench.log`` and ``_picks.log``, Llama-3-8B heads)
the side stream made the step slower, timed cold, in every scheme with merges at 32K over 8 ranks (x0.86-0.94,
0.14-0.37 TFLOP a call) and at 128K over 64 (x0.97, 0.27 TFLOP), and faster at 128K over 8 and 16 (x1.02-1.08,
1.1-5.9 TFLOP a call); with the host ahead of the GPU it was within 1 % either way. One cell went the other
way: 32K over 16, a2a+p2p, 0.27 TFLOP a call, x1.04."""


@contextlib.contextmanager
def inline() -> Iterator[None]:
    """Run the work after each call on the main stream, in order (what the benchmark compares the
    overlap against)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


@contextlib.contextmanager
def everywhere() -> Iterator[None]:
    """Put the work after every call on the side stream, short calls too, as ``MCP_CONTEXT_SIDE_STREAM=1`` does
    (what ``tools/host_costs.py`` weighs the in-order step against where the calls are short)."""
    global _everywhere
    before, _everywhere = _everywhere, True
    try:
        yield
    finally:
        _everywhere = before


_IN_ORDER = contextlib.nullcontext()  # reusable: entering it does nothing


class Inline:
    """Every op in order on the current stream (CPU, fake tensors, or the overlap switched off)."""

    def after(self, *outputs: torch.Tensor) -> ContextManager:
        return _IN_ORDER

    def join(self) -> None:
        pass


@functools.lru_cache(maxsize=None)
def _side(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class SideStream:
    """The work after each attention call on one side stream per device, ordered after the call."""

    def __init__(self, device: torch.device):
        self.main = torch.cuda.current_stream(device)
        self.side = _side(device)

    def after(self, *outputs: torch.Tensor) -> ContextManager:
        """Enter to run work that reads ``outputs`` (just written on the main stream) on the side stream."""
        self.side.wait_stream(self.main)
        for x in outputs:
            x.record_stream(self.side)
        return torch.cuda.stream(self.side)

    def join(self) -> None:
        """The main stream waits for everything the side stream was given."""
        self.main.wait_stream(self.side)


def side_stream_pays(call_flops: float) -> bool:
    """Whether calls of ``call_flops`` forward FLOPs on average put their work on the side stream: never with
    ``MCP_CONTEXT_SIDE_STREAM=0`` or inside ``inline()``, always with ``1`` or inside ``everywhere()``, else from
    ``SIDE_STREAM_MIN_FLOPS``."""
    if not _enabled:
        return False
    chosen = setting(SIDE_STREAM_ENV, "the work after each attention call in order",
                     "on a second CUDA stream after every call",
                     f"a second stream where the calls average {SIDE_STREAM_MIN_FLOPS:.0e} forward FLOPs or more")
    return chosen if chosen is not None else _everywhere or call_flops >= SIDE_STREAM_MIN_FLOPS


def streams_for(x: torch.Tensor, call_flops: float) -> Union[Inline, SideStream]:
    """A side stream for real CUDA tensors where the calls pay for it (``side_stream_pays``; ``call_flops``: their
    mean forward FLOPs, ``RingPlan.call_flops``), else ``Inline``."""
    if side_stream_pays(call_flops) and x.is_cuda and not is_fake(x):  # a bad switch is refused on any device
        return SideStream(x.device)
    return Inline()
