"""Every CP rank as a thread of this process, the collectives and transfers carried between threads.

``--simulate`` used to work the exchange out itself (member spans, K/V laid out by the self-test), so a
fault in the all-to-all, its reordering, the gather or the loss reduction passed it. Here the package's
own code runs on every rank, unchanged: for the duration of ``run_ranks`` the ``torch.distributed``
functions it calls (ranks and sizes of a group, ``all_to_all_single``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_reduce``, ``batch_isend_irecv``) are served between the threads.

Nothing moves before it is matched, so a fault inside a collective is a named failure, not a
transport error or a hang (``ExchangeError``, raised on every rank alike):

- a collective's members must make the same call (operation, shapes, dtype) at the same call number
  of their group;
- a point-to-point transfer must not go to its sender, and the receiver's n-th receive from a rank
  must expect the shape and dtype of that rank's n-th send to it (the ordering gloo and NCCL keep);
- when every rank still running waits and none can go on, the run stops naming what each waits for;
  a send never received fails the run when the ranks are done.

CPU tensors only: the autograd engine runs a CUDA graph's backward on one device thread for every
rank, where the ranks' collectives would wait for each other. Not exercised: gloo and NCCL themselves.
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

WAIT_S = 300.0
"""A rank that waits this long for a peer fails the run (a backstop: a deadlock is found at once)."""


class ExchangeError(RuntimeError):
    """A collective or transfer that does not match on both ends, named by rank, operation and call."""


class SimGroup:
    """A process group of the in-process world: its members' global ranks, in group-rank order."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = tuple(ranks)

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return self.ranks.index(_me())

    def __repr__(self) -> str:
        return f"SimGroup{list(self.ranks)}"


_local = threading.local()


def _me() -> int:
    return _local.rank


class _Work:
    """What ``batch_isend_irecv`` returns: ``wait`` receives (a send is done when posted)."""

    def __init__(self, finish: Callable[[], None]):
        self._finish = finish

    def wait(self, timeout=None) -> bool:
        self._finish()
        return True


class _P2POp:
    def __init__(self, op, tensor: torch.Tensor, peer: int, group=None, tag: int = 0):
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group


class _World:
    """The threads' shared state: collective slots, mailboxes, who waits for what."""

    def __init__(self, size: int, initialized: bool = False):
        self.size, self.initialized = size, initialized
        self.cond = threading.Condition()
        self.broken: Optional[str] = None
        self.culprit: Optional[int] = None                       # the rank that found what broke the run
        self.done: set[int] = set()
        self.waiting: dict[int, tuple[str, Callable[[], bool]]] = {}
        self.slots: dict[tuple, dict[int, tuple]] = {}
        self.calls: dict[tuple, int] = defaultdict(int)          # (rank, group ranks) -> collectives made
        self.sent: dict[tuple, list] = defaultdict(list)         # (src, dst) -> [(tensor or None when taken)]
        self.received: dict[tuple, int] = defaultdict(int)       # (src, dst) -> receives posted
        self.log: list[tuple] = []                               # every call and send, as it was posted

    def fail(self, message: str) -> None:
        with self.cond:
            self.break_run(message)
        raise ExchangeError(message)

    def break_run(self, message: str) -> None:
        """Record the first failure and wake every waiter (call holding ``cond``)."""
        if self.broken is None:
            self.broken, self.culprit = message, _me()
        self.cond.notify_all()

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Block (holding ``cond``) until ``ready()``; a deadlock or a broken run raises."""
        me = _me()
        self.waiting[me] = (what, ready)
        try:
            while not ready():
                if self.broken is not None:
                    raise ExchangeError(self.broken)
                stuck = [r for r in range(self.size) if r not in self.done]
                if all(r in self.waiting and not self.waiting[r][1]() for r in stuck):
                    self.break_run("every rank still running waits and none can go on: " + "; ".join(
                        f"rank {r} waits for {self.waiting[r][0]}" for r in stuck))
                    raise ExchangeError(self.broken)
                if not self.cond.wait(timeout=WAIT_S):
                    self.break_run(f"rank {me} waited {WAIT_S:.0f} s for {what}")
                    raise ExchangeError(self.broken)
        finally:
            del self.waiting[me]

    def collective(self, group: SimGroup, op: str, tensor: torch.Tensor, extra: tuple = ()) -> list[torch.Tensor]:
        """Every member's input of this call of ``group`` (all must make the same call), in group order."""
        me = _me()
        if me not in group.ranks:
            self.fail(f"rank {me} calls {op} on {group}, which it is not a member of")
        with self.cond:
            n = self.calls[(me, group.ranks)]
            self.calls[(me, group.ranks)] += 1
            key = (group.ranks, n)
            slot = self.slots.setdefault(key, {})
            slot[me] = ((op, tuple(tensor.shape), tensor.dtype) + extra, tensor.detach().clone())
            self.log.append((me, group.ranks, n) + slot[me][0])
            self.cond.notify_all()
            self.wait_for(lambda: len(slot) == len(group.ranks), f"{group} to join {op} call {n}")
            calls = {r: slot[r][0] for r in group.ranks}
            inputs = [slot[r][1] for r in group.ranks]
        first = calls[group.ranks[0]]
        differ = [f"rank {r}: {_describe(c)}" for r, c in calls.items() if c != first]
        if differ:
            self.fail(f"{group} call {n}: the members differ (rank {group.ranks[0]}: {_describe(first)}; "
                      + "; ".join(differ) + ")")
        return inputs

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        me = _me()
        if dst == me:
            self.fail(f"rank {me} sends to itself (its point-to-point transfer "
                      f"{sum(len(v) for k, v in self.sent.items() if k[0] == me)})")
        if not 0 <= dst < self.size:
            self.fail(f"rank {me} sends to rank {dst}, outside the world of {self.size}")
        with self.cond:
            self.sent[(me, dst)].append(tensor.detach().clone())
            self.log.append((me, dst, len(self.sent[(me, dst)]) - 1, tuple(tensor.shape), tensor.dtype))
            self.cond.notify_all()

    def post_recv(self, buffer: torch.Tensor, src: int) -> Callable[[], None]:
        me = _me()
        if src == me:
            self.fail(f"rank {me} receives from itself")
        with self.cond:
            n = self.received[(src, me)]
            self.received[(src, me)] += 1

        def finish() -> None:
            box = self.sent[(src, me)]
            with self.cond:
                self.wait_for(lambda: len(box) > n, f"transfer {n} from rank {src}")
                got = box[n]
                box[n] = None
            if got is None or got.shape != buffer.shape or got.dtype != buffer.dtype:
                self.fail(f"transfer {n} from rank {src} to rank {me}: rank {src} sends "
                          f"{_shape(got)}, rank {me} expects {list(buffer.shape)} {buffer.dtype}")
            buffer.copy_(got)
        return finish

    def unreceived(self) -> list[str]:
        return [f"rank {src}'s transfer {n} to rank {dst} was never received"
                for (src, dst), box in self.sent.items() for n, t in enumerate(box) if t is not None]


def _describe(call: tuple) -> str:
    return f"{call[0]} of {list(call[1])} {call[2]}" + (f" {call[3:]}" if len(call) > 3 else "")


def _shape(t: Optional[torch.Tensor]) -> str:
    return "nothing (taken twice)" if t is None else f"{list(t.shape)} {t.dtype}"


def _patched(world: _World) -> dict[str, Callable]:
    """The torch.distributed functions the package calls, served by ``world``."""
    def rank_of(group=None) -> int:
        return _me() if group is None else (group.ranks.index(_me()) if _me() in group.ranks else -1)

    def world_size(group=None) -> int:
        return world.size if group is None else len(group.ranks)

    def all_to_all_single(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        inputs = world.collective(group, "all_to_all_single", inp)
        index = group.ranks.index(_me())
        out.copy_(torch.cat([x.chunk(len(inputs))[index] for x in inputs]).view_as(out))

    def all_gather_into_tensor(out, inp, group=None, async_op=False):
        out.copy_(torch.cat(world.collective(group, "all_gather_into_tensor", inp)).view_as(out))

    def reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        inputs = world.collective(group, "reduce_scatter_tensor", inp, (str(op),))
        index = group.ranks.index(_me())
        out.copy_(torch.stack([x.chunk(len(inputs))[index] for x in inputs]).sum(0).view_as(out))

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        inputs = torch.stack(world.collective(group, "all_reduce", tensor, (str(op),)))
        reduced = {str(dist.ReduceOp.SUM): lambda: inputs.sum(0), str(dist.ReduceOp.MAX): lambda: inputs.max(0).values,
                   str(dist.ReduceOp.MIN): lambda: inputs.min(0).values}[str(op)]()
        tensor.copy_(reduced)

    def batch_isend_irecv(ops) -> list[_Work]:
        works = []
        for p2p in ops:
            peer = p2p.peer
            if p2p.op is isend:
                world.send(p2p.tensor, peer)
                works.append(_Work(lambda: None))
            else:
                works.append(_Work(world.post_recv(p2p.tensor, peer)))
        return works

    def isend(tensor, dst, group=None, tag=0):
        world.send(tensor, dst)
        return _Work(lambda: None)

    def irecv(tensor, src, group=None, tag=0):
        return _Work(world.post_recv(tensor, src))

    def new_group(ranks=None, *args, **kwargs):
        if not world.initialized:
            raise RuntimeError("the in-process world builds no groups: pass SimGroup values")
        return SimGroup(range(world.size) if ranks is None else sorted(ranks))

    return {"get_rank": rank_of, "get_world_size": world_size, "get_process_group_ranks": lambda g: list(g.ranks),
            "get_backend": lambda group=None: "gloo",
            "all_to_all_single": all_to_all_single, "all_gather_into_tensor": all_gather_into_tensor,
            "reduce_scatter_tensor": reduce_scatter_tensor, "all_reduce": all_reduce,
            "batch_isend_irecv": batch_isend_irecv, "P2POp": _P2POp, "isend": isend, "irecv": irecv,
            "new_group": new_group, "is_initialized": lambda: world.initialized}


@contextlib.contextmanager
def _serving(world: _World) -> Iterator[None]:
    """The patched functions for the duration (the calling thread only joins the ranks' threads: under
    torchrun nothing else of this process calls torch.distributed meanwhile)."""
    patches = _patched(world)
    saved = {name: getattr(dist, name) for name in patches}
    for name, fn in patches.items():
        setattr(dist, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def run_ranks(size: int, fn: Callable[[int], object], log: Optional[list] = None, initialized: bool = False) -> list:
    """``fn(rank)`` on ``size`` threads, each playing one rank of an in-process world; every rank's
    result, in rank order. The failure that broke the run (an ``ExchangeError`` naming the rank and
    the call, or what a rank raised) is raised once every thread has stopped. ``log``: filled with
    every collective call and send, sorted (what the ranks compare across processes). ``initialized``:
    the world looks like an initialised process group to code that asks (``dist.is_initialized()``,
    megatron-core's modules) and ``dist.new_group(ranks)`` makes a ``SimGroup`` (code that builds its groups
    at start-up, as dynamic CP's ``build_sub_groups``); without it, ``new_group`` raises (the engine must be
    handed its groups)."""
    world = _World(size, initialized)
    results: list = [None] * size
    errors: dict[int, BaseException] = {}

    def play(rank: int) -> None:
        _local.rank = rank
        try:
            results[rank] = fn(rank)
        except BaseException as err:  # every failure is reported, the first one raised
            errors[rank] = err
            with world.cond:
                world.break_run(f"rank {rank} failed: {type(err).__name__}: {err}")
        finally:
            with world.cond:
                world.done.add(rank)
                world.cond.notify_all()

    with _serving(world):
        threads = [threading.Thread(target=play, args=(r,), name=f"cp-rank-{r}") for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:  # what the rank that broke the run raised (a transfer's error names its step there)
        rank = world.culprit if world.culprit in errors else min(errors)
        err = errors[rank]
        if isinstance(err, ExchangeError) or isinstance(err.__cause__, ExchangeError):
            raise ExchangeError(str(err)) from err
        raise err
    lost = world.unreceived()
    if lost:
        raise ExchangeError("; ".join(lost))
    if log is not None:
        log += sorted(world.log, key=repr)
    return results
