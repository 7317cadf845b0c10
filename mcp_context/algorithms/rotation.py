"""How key/value shards reach a ring member, step by step, and how their gradients get home.

- ``RingRotation`` (p2p): the shard moves one member forward per step; the next transfer is posted
  before the current block is computed (double buffering). K and V travel as one packed message. In
  backward the dK/dV accumulator of a shard travels with it and arrives home after the last step.
  When no member has a task after step ``steps - 1`` (a window, or documents, that reach only the
  nearer shards) the walk stops there: no later transfer is posted, and the last dK/dV hop goes
  straight to the shard's owner.
- ``LocalRotation`` (all-gather, a ring of one, or one member of a ring simulated on one device):
  every shard is already here; a step is a slice of K and V (views, no copy), and gradients are
  accumulated straight into slices of one buffer (the caller's all-gather reduce-scatters it).

``blocks(k, v)`` yields ``(step, k_block, v_block)`` with ``[b, h_kv, n, d]`` blocks;
``gradients(k, dtype)`` gives the object that hands out each step's ``[2, b, h_kv, n, d]`` dK/dV
accumulator (``buffer``), takes it back (``done``) and returns the shard's ``(dk, dv)`` (``result``).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from ..comm.primitives import PeerExchange, PendingExchange, RingExchange
from .. import trace


class RingRotation:
    def __init__(self, kv_exchange: RingExchange, dkv_exchange: RingExchange, ring_size: int,
                 steps: Optional[int] = None):
        self.kv_exchange, self.dkv_exchange, self.ring_size = kv_exchange, dkv_exchange, ring_size
        self.steps = ring_size if steps is None else steps  # steps walked (the last busy step + 1)

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        kv = torch.stack([k, v])  # one message per step: [2, b, h_kv, n, d]
        for step in range(self.steps):
            pending = self.kv_exchange.start(kv, step) if step + 1 < self.steps else None
            yield step, kv[0], kv[1]
            if pending is not None:
                t0 = trace.now()
                kv = pending.wait()
                trace.record("kv_wait", step + 1, t0)

    def gradients(self, k: torch.Tensor, dtype: torch.dtype) -> "RingGradients":
        return RingGradients(self.dkv_exchange, (2,) + tuple(k.shape), dtype, k.device, self.steps)


class RingGradients:
    """dK/dV of the shard held at each step: this member's part goes into a fresh buffer while the
    previous member's sum is in flight, then the two are added and passed on; the last send of every
    member lands each accumulator at its owner (the next member after a full walk; after a walk of
    ``steps`` the member ``steps - 1`` back, sent there directly)."""

    def __init__(self, exchange: RingExchange, shape: tuple, dtype: torch.dtype, device: torch.device,
                 steps: Optional[int] = None):
        self.exchange, self.shape, self.dtype, self.device = exchange, shape, dtype, device
        self.steps = len(exchange.peers) if steps is None else steps
        self.pending: Optional[PendingExchange] = None
        self.home: Optional[torch.Tensor] = None  # a walk of one step: the own shard's dK/dV stays here
        self.step = -1

    def buffer(self, step: int) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def done(self, step: int, dkv: torch.Tensor) -> None:
        if self.pending is not None:
            t0 = trace.now()
            received = self.pending.wait()
            trace.record("dkv_wait", step, t0)
            dkv = received.add_(dkv)
        self.step = step
        if step + 1 < self.steps or self.steps == len(self.exchange.peers):
            self.pending = self.exchange.start(dkv, step)
        elif step == 0:
            self.home = dkv
        else:  # a walk cut short: the accumulator of the shard held now goes straight to its owner
            ex, size = self.exchange, len(self.exchange.peers)
            self.holder = ex.peers[(ex.member + step) % size]  # who holds this member's shard now
            self.pending = PeerExchange({ex.peers[(ex.member - step) % size]: dkv},
                                        {self.holder: torch.empty_like(dkv)}, ex.group, ex.op).start(step)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.home is not None:
            return self.home[0], self.home[1]
        t0 = trace.now()
        received = self.pending.wait()
        trace.record("dkv_wait", self.step + 1, t0)
        if isinstance(received, dict):
            received = received[self.holder]
        return received[0], received[1]


class LocalRotation:
    """Member ``member`` of a ring of ``ring_size`` whose K/V rows (every member's shard, in member
    order) are all on this device."""

    def __init__(self, member: int, ring_size: int):
        self.member, self.ring_size = member, ring_size

    def rows(self, total: int, step: int) -> slice:
        n = total // self.ring_size
        src = (self.member - step) % self.ring_size
        return slice(src * n, (src + 1) * n)

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for step in range(self.ring_size):
            rows = self.rows(k.shape[2], step)
            yield step, k[:, :, rows], v[:, :, rows]

    def gradients(self, k: torch.Tensor, dtype: torch.dtype) -> "LocalGradients":
        return LocalGradients(self, k.new_zeros((2,) + tuple(k.shape), dtype=dtype))


class LocalGradients:
    def __init__(self, rotation: LocalRotation, dkv: torch.Tensor):
        self.rotation, self.dkv = rotation, dkv

    def buffer(self, step: int) -> torch.Tensor:
        return self.dkv[:, :, :, self.rotation.rows(self.dkv.shape[3], step)]

    def done(self, step: int, dkv: torch.Tensor) -> None:
        """Nothing to do: ``buffer`` handed out a view of the shard's own accumulator."""

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dkv[0], self.dkv[1]
