"""Where the work after each attention call runs: on a CUDA device, on a second stream, so the merges
and dQ sums of one call run while the next call computes (TransformerEngine's ring overlaps its
corrections the same way); anywhere else (CPU, fake tensors) in order, as written.

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

from ..switches import switch

_enabled = True
SIDE_STREAM_ENV = "MCP_CONTEXT_SIDE_STREAM"
"""``0`` runs the work after each call in order on the calls' own stream (the same results; for comparing,
or if the overlap misbehaves on a machine); ``1`` or unset: the side stream on CUDA."""


def side_stream_enabled() -> bool:
    """``MCP_CONTEXT_SIDE_STREAM`` (``0`` or ``1``; unset is ``1``) and no ``inline()`` in effect."""
    return _enabled and switch(SIDE_STREAM_ENV, "the work after each attention call in order",
                               "on a second CUDA stream")


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


class Inline:
    """Every op in order on the current stream (CPU, fake tensors, or the overlap switched off)."""

    def after(self, *outputs: torch.Tensor) -> ContextManager:
        return contextlib.nullcontext()

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


def streams_for(x: torch.Tensor) -> Union[Inline, SideStream]:
    """A side stream for real CUDA tensors while the overlap is on (``side_stream_enabled``), else ``Inline``."""
    if side_stream_enabled() and x.is_cuda and not is_fake(x):  # a bad switch is refused on any device
        return SideStream(x.device)
    return Inline()
