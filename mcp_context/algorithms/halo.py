"""The halo rotation: a ring step brings only the key/value rows this member's tasks read, from their owner.

With a sliding window shorter than a shard most ring steps have no task and the others read a few
rows of the arriving shard (``Schedule.kv_rows``). At step ``t`` member ``m`` sends member ``m + t``
exactly the rows of its own shard that ``m + t`` reads at that step — straight from the owner, no
relaying — and a step nobody reads from posts nothing and is not walked. In backward the dK/dV of
those rows go straight back to their owner. Every member derives every transfer from the same
schedule, so sends and receives match without a handshake.

A walk posts all its transfers up front (they overlap step 0's block), so it holds every received
halo at once: ``resolve_scheme`` uses this rotation only for a window whose largest halo fits in the
two shards a ring's double buffer holds (``halo_fits``), and the ring otherwise. Message order
between two ranks is the same on both sides: the K/V of a walk are posted before the dK/dV of the
backward (sent step by step, received at the end).
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from ..comm.primitives import PeerExchange, PendingExchange
from ..schedule import Schedule
from ..merge import add_kv_
from .packing import pack_kv, split_kv
from .rotation import bhsd, rows_of

Rows = tuple[tuple[int, int], ...]
Connect = Callable[..., PeerExchange]
"""``connect(sends, recvs, op=...)``: one step's transfers (``PeerExchange`` over the CP group, bound with
``functools.partial(PeerExchange, group=...)``; a checker's stand-in in tests)."""


def halo_fits(schedule: Schedule) -> bool:
    """True when every member's received rows (all steps but its own) fit in two shards (asked member by member,
    step by step, until one does not: each ask derives a step's rows from the mask)."""
    size = schedule.ring_size
    room = 2 * sum(s.count for s in schedule.member_spans[0])
    for m in range(size):
        received = 0
        for t in range(1, size):
            received += sum(b - a for a, b in schedule.kv_rows(m, t))
            if received > room:
                return False
    return True


def _take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Rows ``rows`` of ``x [b, h, n, dqk + dv]`` (``pack_kv``) along dim 2, packed into one contiguous message."""
    return torch.cat([x[:, :, a:b] for a, b in rows], dim=2).contiguous()


def _put(dst: torch.Tensor, rows: Rows, packed: torch.Tensor, add: bool = False) -> None:
    """Unpack ``packed`` (from ``_take``) into rows ``rows`` of ``dst``, adding when ``add``."""
    offset = 0
    for a, b in rows:
        part = packed[:, :, offset:offset + b - a]
        if add:
            dst[:, :, a:b] += part
        else:
            dst[:, :, a:b] = part
        offset += b - a


def _shape(like: torch.Tensor, rows: Rows) -> tuple[int, ...]:
    return tuple(like.shape[:2]) + (sum(b - a for a, b in rows), like.shape[3])


class HaloRotation:
    """Member ``member`` of the ring whose global ranks are ``peers`` (member order), exchanging halos through
    ``connect`` (each step's ``PeerExchange``)."""

    complete_sums = False  # a halo's dK/dV go home to be added
    captures = False  # point-to-point transfers per step: not captured (graphs)

    def __init__(self, schedule: Schedule, member: int, peers: Sequence[int], connect: Connect):
        size = schedule.ring_size
        self.member, self.peers, self.connect, self.ring_size = member, list(peers), connect, size
        # step -> rows this member reads of the shard it holds then; rows its shard gives member m + t
        self.recv_rows = {t: r for t in range(1, size) if (r := schedule.kv_rows(member, t))}
        self.send_rows = {t: r for t in range(1, size) if (r := schedule.kv_rows((member + t) % size, t))}

    def _src(self, step: int) -> int:
        return self.peers[(self.member - step) % self.ring_size]

    def _dst(self, step: int) -> int:
        return self.peers[(self.member + step) % self.ring_size]

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        kv, dqk = bhsd(pack_kv(k, v)), k.shape[-1]  # [b, h_kv, n, dqk + dv]
        pending: dict[int, PendingExchange] = {}
        for t in sorted(set(self.recv_rows) | set(self.send_rows)):
            sends = {self._dst(t): _take(kv, self.send_rows[t])} if t in self.send_rows else {}
            recvs = ({self._src(t): kv.new_empty(_shape(kv, self.recv_rows[t]))} if t in self.recv_rows else {})
            pending[t] = self.connect(sends, recvs, op="ring_kv").start(t)
        yield 0, k, v
        for t, rows in self.recv_rows.items():
            block = kv.new_zeros(kv.shape)  # rows no task reads stay zero and are never read
            _put(block, rows, pending.pop(t).wait()[self._src(t)])
            yield t, *split_kv(block, dqk)
        for exchange in pending.values():  # steps this member only sends at
            exchange.wait()

    def gradients(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> "HaloGradients":
        shape = tuple(k.shape[:-1]) + (k.shape[-1] + v.shape[-1],)
        return HaloGradients(self, k.new_zeros(shape, dtype=dtype), k.shape[-1])


class HaloGradients:
    """dK/dV: this member's own shard accumulates in place; a halo's dK/dV goes back to its owner
    when its step is done, and the halos of this member's rows are received and added at the end."""

    def __init__(self, rotation: HaloRotation, own: torch.Tensor, dqk: int):
        self.rotation, self.own, self.dqk = rotation, own, dqk
        self.halo: dict[int, torch.Tensor] = {}  # step -> the dK/dV of the halo held then
        self.sent: list[PendingExchange] = []

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        return self.rotation.blocks(k, v)

    def add(self, step: int, rows: tuple[int, int], dk: torch.Tensor, dv: torch.Tensor) -> None:
        if step == 0:
            target = self.own
        else:
            if step not in self.halo:  # rows no task reads stay zero and are never sent
                self.halo[step] = torch.zeros_like(self.own)
            target = self.halo[step]
        add_kv_(rows_of(target, rows), dk, dv)

    def done(self, step: int) -> None:
        if step > 0:
            r = self.rotation
            dkv = self.halo.pop(step, None)
            if dkv is None:
                dkv = torch.zeros_like(self.own)
            send = r.connect({r._src(step): _take(dkv, r.recv_rows[step])}, {}, op="ring_dkv")
            self.sent.append(send.start(step))

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rotation
        for t, rows in r.send_rows.items():
            got = r.connect({}, {r._dst(t): self.own.new_empty(_shape(self.own, rows))}, op="ring_dkv").start(t).wait()
            _put(self.own, rows, got[r._dst(t)], add=True)
        for pending in self.sent:
            pending.wait()
        return split_kv(self.own, self.dqk)
