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

``blocks(k, v)`` yields ``(step, k_block, v_block)`` with ``[b, h_kv, n, dqk]`` and ``[b, h_kv, n, dv]``
blocks; ``gradients(k, v, dtype)`` gives the object that adds each block's dK/dV into the accumulator of
the shard held at that step (``add``: one fused kernel, ``merge.add_kv_``, into a ``[b, h_kv, n, dqk + dv]``
buffer, dK in the first ``dqk`` columns, dV after), is told when a step is done (``done``) and returns
the shard's ``(dk, dv)`` (``result``). A ring adds straight into the partial sum that arrived from the
previous member (no fresh buffer, fill or extra add per step). K and V travel as one message the same way (``pack_kv``),
each keeping its own head dim (MLA's ``dv != dqk``), so the bytes sent are exactly K's plus V's.
"""
from __future__ import annotations

from typing import Iterator, Optional, Protocol

import torch

from ..comm.primitives import PeerExchange, PendingExchange, RingExchange
from .. import trace
from ..merge import add_kv_


class Gradients(Protocol):
    """Where a walk's dK/dV go: each block's are added into the accumulator of the shard held at its
    step, the step is closed when its blocks are done, and the shard's own ``(dk, dv)`` come at the end."""

    def add(self, step: int, rows: tuple[int, int], dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add one block's ``dk [b, h_kv, r, dqk]``, ``dv [b, h_kv, r, dv]`` into rows ``rows`` of the
        accumulator of the shard held at ``step``."""

    def done(self, step: int) -> None:
        """``step``'s blocks are all added (send the accumulator on, or nothing when it stays here)."""

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This member's shard's ``dk [b, h_kv, n, dqk]``, ``dv [b, h_kv, n, dv]``."""


def rows_of(x: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    """Rows ``rows`` (dim 2) of a ``[b, h, n, ...]`` tensor, as a view (``narrow``: see executor._rows)."""
    return x.narrow(2, rows[0], rows[1] - rows[0])


class Rotation(Protocol):
    """How K/V shards reach a ring member step by step (``blocks``) and their gradients get home."""

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(step, k_block, v_block)`` for every step walked."""

    def gradients(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> Gradients:
        """The dK/dV accumulators of a backward walk, in ``dtype``."""


def bhsd(x: torch.Tensor) -> torch.Tensor:
    """``x [n, b, h, d]`` (token-major storage) viewed as ``[b, h, n, d]``, the order the kernels index."""
    return x.permute(1, 2, 0, 3)


def token_major_zeros(like: torch.Tensor, dims: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero ``[n, b, h, dims]`` buffer for the rows of ``like [b, h, n, ...]``: dK/dV accumulators and
    messages are token-major, the storage order of the inputs and of the fused ops' gradients, so every
    add and copy between them reads and writes memory in the same order."""
    b, h, n = like.shape[:3]
    return torch.zeros((n, b, h, dims), dtype=dtype, device=like.device)


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``k [b, h_kv, n, dqk]``, ``v [b, h_kv, n, dv]`` (views of token-major storage) -> one contiguous
    ``[n, b, h_kv, dqk + dv]`` message (view it with ``bhsd``)."""
    return torch.cat([k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)], dim=-1)


def split_kv(kv: torch.Tensor, dqk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of K and V in a ``[b, h_kv, n, dqk + dv]`` view of a ``pack_kv`` message (or of a dK/dV
    accumulator) whose keys have ``dqk`` columns."""
    return kv.narrow(-1, 0, dqk), kv.narrow(-1, dqk, kv.shape[-1] - dqk)  # narrow: see executor._rows


class RingRotation:
    def __init__(self, kv_exchange: RingExchange, dkv_exchange: RingExchange, ring_size: int,
                 steps: Optional[int] = None):
        self.kv_exchange, self.dkv_exchange, self.ring_size = kv_exchange, dkv_exchange, ring_size
        self.steps = ring_size if steps is None else steps  # steps walked (the last busy step + 1)

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        kv, dqk = pack_kv(k, v), k.shape[-1]  # one message per step
        for step in range(self.steps):
            pending = self.kv_exchange.start(kv, step) if step + 1 < self.steps else None
            yield step, *split_kv(bhsd(kv), dqk)
            if pending is not None:
                t0 = trace.now()
                kv = pending.wait()
                trace.record("kv_wait", step + 1, t0)

    def gradients(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> "RingGradients":
        return RingGradients(self.dkv_exchange, k, k.shape[-1] + v.shape[-1], k.shape[-1], dtype, self.steps)


class RingGradients:
    """dK/dV of the shard held at each step: at step 0 this member's part goes into a fresh buffer; at a
    later step the previous member's partial sum for the shard held now has arrived (it was sent while
    this member computed), and this member's blocks are added straight into it before it is passed on.
    The last send of every member lands each accumulator at its owner (the next member after a full
    walk; after a walk of ``steps`` the member ``steps - 1`` back, sent there directly)."""

    def __init__(self, exchange: RingExchange, k: torch.Tensor, dims: int, dqk: int, dtype: torch.dtype,
                 steps: Optional[int] = None):
        self.exchange, self.k, self.dims, self.dqk, self.dtype = exchange, k, dims, dqk, dtype
        self.steps = len(exchange.peers) if steps is None else steps
        self.pending: Optional[PendingExchange[torch.Tensor]] = None  # the ring's hop in flight
        self.cut_short: Optional[tuple[PendingExchange[dict[int, torch.Tensor]], int]] = None  # (hop home, from)
        self.home: Optional[torch.Tensor] = None  # a walk of one step: the own shard's dK/dV stays here
        self.current: Optional[torch.Tensor] = None  # [n, b, h_kv, dqk + dv]: the shard held at this step
        self.step = -1

    def _accumulator(self, step: int) -> torch.Tensor:
        if self.current is None:
            if self.pending is None:  # step 0: this member's own part starts the sum
                self.current = token_major_zeros(self.k, self.dims, self.dtype)
            else:
                t0 = trace.now()
                self.current = self.pending.wait()
                self.pending = None
                trace.record("dkv_wait", step, t0)
        return self.current

    def add(self, step: int, rows: tuple[int, int], dk: torch.Tensor, dv: torch.Tensor) -> None:
        add_kv_(rows_of(bhsd(self._accumulator(step)), rows), dk, dv)

    def done(self, step: int) -> None:
        dkv, self.current = self._accumulator(step), None
        self.step = step
        if step + 1 < self.steps or self.steps == len(self.exchange.peers):
            self.pending = self.exchange.start(dkv, step)
        elif step == 0:
            self.home = dkv
        else:  # a walk cut short: the accumulator of the shard held now goes straight to its owner
            ex, size = self.exchange, len(self.exchange.peers)
            holder = ex.peers[(ex.member + step) % size]  # who holds this member's shard now
            self.cut_short = (PeerExchange({ex.peers[(ex.member - step) % size]: dkv},
                                           {holder: torch.empty_like(dkv)}, ex.group, ex.op).start(step), holder)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.home is not None:
            return split_kv(bhsd(self.home), self.dqk)
        t0 = trace.now()
        if self.cut_short is not None:
            pending, holder = self.cut_short
            received = pending.wait()[holder]
        else:
            received = self.pending.wait()
        trace.record("dkv_wait", self.step + 1, t0)
        return split_kv(bhsd(received), self.dqk)


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
            yield step, k.narrow(2, rows.start, rows.stop - rows.start), v.narrow(2, rows.start, rows.stop - rows.start)

    def gradients(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> "LocalGradients":
        return LocalGradients(self, bhsd(token_major_zeros(k, k.shape[-1] + v.shape[-1], dtype)), k.shape[-1])


class LocalGradients:
    def __init__(self, rotation: LocalRotation, dkv: torch.Tensor, dqk: int):
        self.rotation, self.dkv, self.dqk = rotation, dkv, dqk

    def add(self, step: int, rows: tuple[int, int], dk: torch.Tensor, dv: torch.Tensor) -> None:
        shard = self.rotation.rows(self.dkv.shape[2], step)
        add_kv_(rows_of(self.dkv, (shard.start + rows[0], shard.start + rows[1])), dk, dv)

    def done(self, step: int) -> None:
        """Nothing to do: every block was added straight into the shard's own accumulator."""

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return split_kv(self.dkv, self.dqk)
