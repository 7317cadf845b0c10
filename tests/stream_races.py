"""A race checker for the executor's second stream and a ring's transfers, on CPU: the step runs in order,
as on CPU, while a dispatch mode keeps the order a CUDA device would give it and reports every pair of
accesses two streams could make at once.

``Simulated`` stands where ``streams.SideStream`` stands on a GPU (the executor takes it from
``streams_for``) and follows the same protocol: ``after(*outputs)`` makes the side stream wait for the
main stream (``wait_stream``) and marks the outputs as used there (``record_stream``); ops run inside its
scope are side-stream ops; ``join()`` makes the main stream wait for the side stream. ``StreamRaces``
records which bytes of which storage each op reads and writes (views are not accesses; an in-place op
writes what its schema marks ``a!``) and reports, with the ops' names:

- **concurrent access**: a main-stream op and a side-stream op on overlapping bytes, one of them a write,
  with no wait ordering them (a side op not yet joined against a later main op; a main op the side stream
  has not waited for against a later side op);
- **freed in use**: memory a pending side-stream op touches, freed before a join and not marked with
  ``record_stream``: the caching allocator could hand it to the main stream's next op.

A ring's transfers are a third stream (``CheckedExchange``, standing where ``RingExchange`` stands): a
transfer reads its send buffer and writes its receive buffer from when it is posted, after the main
stream's work so far (NCCL's stream waits for the current one), until it is waited for; nothing orders it
with the side stream. Any main or side op on those bytes meanwhile (one of them writing), or a transfer of
bytes a side op not yet joined writes, is a concurrent access too.

Bytes are compared exactly (element by element where the extents overlap), so disjoint rows or columns
of one buffer are not a race. The ``wait``, ``record`` and ``joins`` switches break one rule each, so a
test can show the checker catches that rule being broken.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class _Bytes:
    """Which bytes of its storage a tensor covers (no reference to the tensor: the checker must not keep
    memory alive)."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    itemsize: int

    @classmethod
    def of(cls, t: torch.Tensor) -> "_Bytes":
        return cls(t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.element_size())

    def extent(self) -> tuple[int, int]:
        span = sum((s - 1) * st for s, st in zip(self.shape, self.stride) if s > 0)
        return self.offset * self.itemsize, (self.offset + span + 1) * self.itemsize

    def dense(self) -> bool:
        return self.extent()[1] - self.extent()[0] == self.itemsize * torch.Size(self.shape).numel()

    def starts(self) -> torch.Tensor:
        """The first byte of every element."""
        off = torch.full((), self.offset, dtype=torch.int64)
        for size, stride in zip(self.shape, self.stride):
            off = off.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
        return off.flatten() * self.itemsize

    def overlaps(self, other: "_Bytes") -> bool:
        (a0, a1), (b0, b1) = self.extent(), other.extent()
        if a1 <= b0 or b1 <= a0:
            return False
        if self.dense() or other.dense() or self.itemsize != other.itemsize:  # every byte in the extent
            return True
        return bool(torch.isin(self.starts(), other.starts()).any())


@dataclass
class _Access:
    op: str
    storage: StorageWeakRef
    bytes: _Bytes
    write: bool
    stream: str  # "main", "side" or "transfer"
    scope: int
    safe_to_free: bool  # memory the side stream allocated (its own pool), or marked with record_stream


class StreamRaces(TorchDispatchMode):
    """Records each op's accesses on the stream it is issued to and collects the races (``races``)."""

    def __init__(self):
        super().__init__()
        self.side = False
        self.scope = 0
        self.pending_side: list[_Access] = []    # side accesses no join has ordered before the main stream
        self.unwaited_main: list[_Access] = []   # main accesses the side stream has not waited for
        self.recorded: list[StorageWeakRef] = []
        self.side_owned: list[StorageWeakRef] = []
        self.in_flight: dict[int, list[_Access]] = {}  # transfers posted and not yet waited for
        self.transfers = 0
        self.races: list[str] = []

    # the protocol's two waits
    def side_waits(self) -> None:
        self.unwaited_main = []

    def main_waits(self) -> None:
        self.pending_side = []
        self.recorded = []

    def start_transfer(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> int:
        """A transfer posted now reads ``sends`` and writes ``recvs`` until ``end_transfer``. Its stream waits
        for the main stream's work so far (NCCL's stream waits for the current one), not for the side
        stream's: a side write not yet joined to bytes it moves is a race."""
        self.transfers += 1
        moved = [(x, False) for x in sends] + [(x, True) for x in recvs]
        accesses = [_Access(f"transfer {self.transfers}", StorageWeakRef(x.untyped_storage()), _Bytes.of(x), write,
                            "transfer", self.scope, True) for x, write in moved if x.numel()]
        for i, a in enumerate(accesses):
            self._conflicts(a, self.pending_side)
            self._conflicts(a, accesses[:i])  # a receive into bytes the same transfer sends
        self.in_flight[self.transfers] = accesses
        return self.transfers

    def end_transfer(self, token: int) -> None:
        """The main stream waits for the transfer (``wait``)."""
        del self.in_flight[token]

    def record(self, x: torch.Tensor) -> None:
        self.recorded.append(StorageWeakRef(x.untyped_storage()))

    @staticmethod
    def _among(ref: StorageWeakRef, refs: list[StorageWeakRef]) -> bool:
        return any(r.cdata == ref.cdata and not r.expired() for r in refs)

    def _check_freed(self, op: str) -> None:
        for a in self.pending_side:
            if a.storage.expired() and not a.safe_to_free:
                self.races.append(f"freed in use: memory the side stream's {a.op} (scope {a.scope}) "
                                  f"{'writes' if a.write else 'reads'} was freed before a join, without "
                                  f"record_stream, and the main stream's {op} ran next")
        self.pending_side = [a for a in self.pending_side if not a.storage.expired()]
        self.side_owned = [r for r in self.side_owned if not r.expired()]

    def _conflicts(self, new: _Access, others: list[_Access]) -> None:
        for a in others:
            if (new.write or a.write) and a.storage.cdata == new.storage.cdata and not a.storage.expired() \
                    and a.bytes.overlaps(new.bytes):
                self.races.append(
                    f"concurrent access: {a.stream} stream's {a.op} {'writes' if a.write else 'reads'} bytes the "
                    f"{new.stream} stream's {new.op} {'writes' if new.write else 'reads'}, with no wait between "
                    f"them (scope {max(a.scope, new.scope)})")

    def _accesses(self, func, args, kwargs, out) -> list[tuple[torch.Tensor, bool, bool]]:
        """``(tensor, written, fresh)`` for every tensor the op reads or writes."""
        schema = func._schema
        found: list[tuple[torch.Tensor, bool, bool]] = []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            write = arg.alias_info is not None and arg.alias_info.is_write
            for x in tree_flatten(value)[0]:
                if isinstance(x, torch.Tensor) and x.numel():
                    found.append((x, write, False))
        aliased = {r for r, ret in enumerate(schema.returns) if ret.alias_info is not None}
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for r, x in enumerate(outs):
            if r not in aliased and isinstance(x, torch.Tensor) and x.numel():
                found.append((x, True, True))  # a fresh output: written by this op
        return found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        returns = func._schema.returns
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return out  # a view: no bytes move
        name = str(func.overloadpacket.__name__)
        if not self.side:
            self._check_freed(name)
        for x, write, fresh in self._accesses(func, args, kwargs, out):
            ref = StorageWeakRef(x.untyped_storage())
            if self.side and fresh:
                self.side_owned.append(ref)
            safe = self.side and (self._among(ref, self.side_owned) or self._among(ref, self.recorded))
            new = _Access(name, ref, _Bytes.of(x), write, "side" if self.side else "main", self.scope, safe)
            self._conflicts(new, self.unwaited_main if self.side else self.pending_side)
            for transfer in self.in_flight.values():
                self._conflicts(new, transfer)
            (self.pending_side if self.side else self.unwaited_main).append(new)
        return out


class Simulated:
    """The executor's side stream on CPU, for ``StreamRaces`` (see the module's docstring). ``wait``,
    ``record`` and ``joins`` False each break one rule of the protocol (a checker's own test)."""

    def __init__(self, races: StreamRaces, wait: bool = True, record: bool = True, joins: bool = True):
        self.races, self.wait, self.record, self.joins = races, wait, record, joins
        self.scopes = 0

    @contextlib.contextmanager
    def after(self, *outputs: torch.Tensor) -> Iterator[None]:
        if self.wait:
            self.races.side_waits()
        if self.record:
            for x in outputs:
                self.races.record(x)
        self.scopes += 1
        self.races.side, self.races.scope = True, self.scopes
        try:
            yield
        finally:
            self.races.side = False

    def join(self) -> None:
        if self.joins:
            self.races.main_waits()


class _InFlight:
    def __init__(self, races: StreamRaces, token: int, received, sent):
        self.races, self.token, self.received, self.sent = races, token, received, sent  # sent: alive until waited

    def wait(self):
        self.races.end_transfer(self.token)
        self.sent = None
        return self.received


class _CheckedPeers:
    """One step's transfers with any peers (as ``PeerExchange``), checked like a ring's."""

    def __init__(self, races: StreamRaces, sends: dict, recvs: dict):
        self.races, self.sends, self.recvs = races, sends, recvs

    def start(self, step: int) -> _InFlight:
        token = self.races.start_transfer(list(self.sends.values()), list(self.recvs.values()))
        return _InFlight(self.races, token, self.recvs, self.sends)


class CheckedExchange:
    """A ring's transfers that move nothing (as ``tools.rank_step.NoWireExchange``) and tell ``StreamRaces``
    what they read and write while in flight (``start_transfer``), until they are waited for: ``start`` as
    ``RingExchange.start``, ``to_peers`` as ``RingExchange.to_peers``, and ``connect`` as the halo's
    ``PeerExchange`` (``halo.Connect``)."""

    captures = False  # it records host-side what each transfer touches: a replay would record nothing

    def __init__(self, races: StreamRaces, ring_size: int, member: int):
        self.races, self.peers, self.member, self.group, self.op = races, list(range(ring_size)), member, None, "checked"

    def start(self, send: torch.Tensor, step: int, recv: Optional[torch.Tensor] = None, parts=None) -> _InFlight:
        recv = torch.empty_like(send) if recv is None else recv
        return _InFlight(self.races, self.races.start_transfer([send], [recv]), recv, send)

    def to_peers(self, sends: dict, recvs: dict) -> _CheckedPeers:
        return _CheckedPeers(self.races, sends, recvs)

    def connect(self, sends: dict, recvs: dict, op: str) -> _CheckedPeers:
        return self.to_peers(sends, recvs)


def races_of(run: Callable, wait: bool = True, record: bool = True, joins: bool = True,
             read_after: Optional[Callable] = None) -> tuple[list[str], int]:
    """``run(streams)`` under the checker (``streams``: a ``Simulated`` to hand the executor; its ``races``
    serves a ``CheckedExchange``), then ``read_after(result)`` on the main stream, as a caller reads the
    results; the races found and how many side-stream scopes the step entered."""
    races = StreamRaces()
    sim = Simulated(races, wait, record, joins)
    with races:
        result = run(sim)
        if read_after is not None:
            read_after(result)
    return races.races, sim.scopes
