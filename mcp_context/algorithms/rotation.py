"""How key/value shards reach a ring member, step by step, and how their gradients get home.

- ``RingRotation`` (p2p): the shard moves one member forward per step; the next transfer is posted
  before the current block is computed (double buffering). In backward the dK/dV accumulator of a
  shard travels with it and arrives home after the last step.
- ``LocalRotation`` (all-gather, or a ring of one): every shard is already here in one buffer; a
  step is a slice. Gradients accumulate into one buffer (the caller's all-gather reduce-scatters it).

Both yield ``(step, kv)`` with ``kv [2, b, h_kv, n, d]`` (keys and values packed, one message).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from ..comm.primitives import PendingExchange, RingExchange
from . import timeline


class RingRotation:
    def __init__(self, kv_exchange: RingExchange, dkv_exchange: RingExchange, ring_size: int):
        self.kv_exchange, self.dkv_exchange, self.ring_size = kv_exchange, dkv_exchange, ring_size

    def blocks(self, kv: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        for step in range(self.ring_size):
            pending = self.kv_exchange.start(kv, step) if step + 1 < self.ring_size else None
            yield step, kv
            if pending is not None:
                t0 = timeline.now()
                kv = pending.wait()
                timeline.record("kv_wait", step + 1, t0)

    def gradients(self, kv: torch.Tensor, dtype: torch.dtype) -> "RingGradients":
        return RingGradients(self.dkv_exchange)


class RingGradients:
    """dK/dV of the shard held at each step: add this member's part, pass the sum on; the last send
    of every member lands each accumulator at its owner."""

    def __init__(self, exchange: RingExchange):
        self.exchange = exchange
        self.pending: Optional[PendingExchange] = None
        self.step = -1

    def add(self, step: int, dkv: torch.Tensor) -> None:
        if self.pending is not None:
            t0 = timeline.now()
            received = self.pending.wait()
            timeline.record("dkv_wait", step, t0)
            dkv = received.add_(dkv)
        self.pending, self.step = self.exchange.start(dkv, step), step

    def result(self) -> torch.Tensor:
        t0 = timeline.now()
        received = self.pending.wait()
        timeline.record("dkv_wait", self.step + 1, t0)
        return received


class LocalRotation:
    def __init__(self, member: int, ring_size: int):
        self.member, self.ring_size = member, ring_size

    def _rows(self, kv: torch.Tensor, step: int) -> slice:
        n = kv.shape[3] // self.ring_size
        src = (self.member - step) % self.ring_size
        return slice(src * n, (src + 1) * n)

    def blocks(self, kv: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        for step in range(self.ring_size):
            yield step, kv[:, :, :, self._rows(kv, step)]

    def gradients(self, kv: torch.Tensor, dtype: torch.dtype) -> "LocalGradients":
        return LocalGradients(self, kv.new_zeros(kv.shape, dtype=dtype))


class LocalGradients:
    def __init__(self, rotation: LocalRotation, buffer: torch.Tensor):
        self.rotation, self.buffer = rotation, buffer

    def add(self, step: int, dkv: torch.Tensor) -> None:
        self.buffer[:, :, :, self.rotation._rows(self.buffer, step)] += dkv

    def result(self) -> torch.Tensor:
        return self.buffer
