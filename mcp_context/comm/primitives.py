"""Communication primitives for context-parallel attention, each recording the bytes it sends, and to
whom, in ``mcp_context.trace.comm_stats``.

- ``RingExchange``: send a tensor to the next ring member while receiving from the previous one, as
  one batched isend/irecv pair; ``start`` returns at once so the transfer overlaps compute, ``wait``
  gives the received tensor and names rank, step and peers if the transfer times out.
- ``PeerExchange``: one step's sends and receives with any peers and sizes (the halo of a window).
- ``seq_to_heads`` / ``heads_to_seq``: the Ulysses all-to-all ``[s, b, h, d] <-> [P*s, b, h/P, d]``
  (autograd-aware: each one's backward is the other).
- ``gather_seq``: all-gather along the sequence (autograd-aware: backward is a reduce-scatter).
  ``torch.distributed.nn.functional.all_gather`` is not used: on gloo its backward is wrong.
  ``gather_seq_among`` does the same among some ranks of a group (the outer members of a hierarchy)
  with point-to-point transfers, so no process group is needed for them at any depth.
"""
from __future__ import annotations

import datetime
import os
from typing import Generic, Optional, Sequence, TypeVar, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..trace import comm_stats

COMM_TIMEOUT_S = float(os.environ.get("MCP_CONTEXT_COMM_TIMEOUT_S", "600"))


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _others(group: ProcessGroup) -> list[int]:
    """Global ranks of ``group``'s other members (where a collective's data goes)."""
    me = dist.get_rank()
    return [r for r in dist.get_process_group_ranks(group) if r != me]


class RingExchange:
    """Point-to-point neighbours of one ring: ``peers`` are global ranks in ring order. ``captures``: False,
    its transfers have not been replayed from a CUDA graph on our machines (NCCL can capture point-to-point
    operations; one GPU cannot run two ranks to check it), so a ring's step is not captured."""

    captures = False

    def __init__(self, peers: Sequence[int], member: int, group: ProcessGroup, op: str):
        self.peers, self.member, self.group, self.op = list(peers), member, group, op
        self.next = self.peers[(member + 1) % len(self.peers)]
        self.prev = self.peers[(member - 1) % len(self.peers)]

    def start(self, send: torch.Tensor, step: int, recv: Optional[torch.Tensor] = None,
              parts: Optional[dict[str, int]] = None) -> "PendingExchange[torch.Tensor]":
        """Send ``send`` to the next member and receive the previous member's into ``recv`` (a new tensor
        like ``send`` by default). ``parts``: the message carries several operations' data (K/V and dK/dV
        in one buffer): their bytes by operation name, recorded as such (default: all of it as ``op``)."""
        recv = torch.empty_like(send) if recv is None else recv
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group),
                                        dist.P2POp(dist.irecv, recv, self.prev, self.group)])
        for op, nbytes in (parts or {self.op: _nbytes(send)}).items():
            comm_stats.record(op, {self.next: nbytes})
        return PendingExchange(works, recv, send, self, step)

    def to_peers(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> "PeerExchange":
        """One step's transfers with any ranks of this ring's group, recorded under its operation (a walk cut
        short sends a shard's dK/dV straight to its owner)."""
        return PeerExchange(sends, recvs, self.group, self.op)

    def describe(self, step: int) -> str:
        """Which transfer this is, for error messages: operation, step, this rank and its peers."""
        return (f"{self.op} ring step {step}: rank {dist.get_rank()} sending to {self.next}, "
                f"receiving from {self.prev}")


R = TypeVar("R")


class PendingExchange(Generic[R]):
    """A posted transfer; ``wait`` gives what was received: a tensor for ``RingExchange``, a
    ``{peer: tensor}`` dict for ``PeerExchange``."""

    def __init__(self, works: list, recv: R, send, exchange: Union["RingExchange", "PeerExchange"], step: int):
        self._works, self._recv, self._exchange, self._step = works, recv, exchange, step
        self._send = send  # keep the send buffer alive until the transfer is done

    def wait(self) -> R:
        for work in self._works:
            try:
                done = work.wait(timeout=datetime.timedelta(seconds=COMM_TIMEOUT_S))
            except RuntimeError as err:
                raise RuntimeError(f"{self._exchange.describe(self._step)} failed: {err}") from err
            if done is False:
                raise RuntimeError(f"{self._exchange.describe(self._step)} timed out after {COMM_TIMEOUT_S:.0f} s "
                                   f"(set MCP_CONTEXT_COMM_TIMEOUT_S to change)")
        self._send = None
        return self._recv


class PeerExchange:
    """One step's point-to-point transfers with any peers, each of its own size: ``sends`` and ``recvs``
    map global ranks to tensors (a halo: only the rows the receiver reads). No peer, no message."""

    def __init__(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], group: ProcessGroup,
                 op: str):
        self.sends, self.recvs, self.group, self.op = sends, recvs, group, op

    def start(self, step: int) -> PendingExchange[dict[int, torch.Tensor]]:
        ops = [dist.P2POp(dist.isend, x, peer, self.group) for peer, x in self.sends.items()]
        ops += [dist.P2POp(dist.irecv, x, peer, self.group) for peer, x in self.recvs.items()]
        if self.sends:
            comm_stats.record(self.op, {peer: _nbytes(x) for peer, x in self.sends.items()})
        return PendingExchange(dist.batch_isend_irecv(ops) if ops else [], self.recvs, self.sends, self, step)

    def describe(self, step: int) -> str:
        return (f"{self.op} halo step {step}: rank {dist.get_rank()} sending to {sorted(self.sends)}, "
                f"receiving from {sorted(self.recvs)}")


def _all_to_all(x: torch.Tensor, group: ProcessGroup, op: str) -> torch.Tensor:
    """All-to-all over the leading dim of ``x [P, ...]``: rank j's ``out[i]`` is rank i's ``x[j]``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    comm_stats.record(op, dict.fromkeys(_others(group), _nbytes(x) // x.shape[0]))  # chunk j to member j
    return out


def _seq_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    p = dist.get_world_size(group)
    s, b, h, d = x.shape
    chunks = x.reshape(s, b, p, h // p, d).movedim(2, 0)  # [P, s, b, h/P, d]: chunk j goes to rank j
    return _all_to_all(chunks, group, "all_to_all").reshape(p * s, b, h // p, d)


def _heads_to_seq(y: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    p = dist.get_world_size(group)
    ps, b, hp, d = y.shape
    chunks = y.reshape(p, ps // p, b, hp, d)  # chunk i holds rank i's tokens
    return _all_to_all(chunks, group, "all_to_all").movedim(0, 2).reshape(ps // p, b, p * hp, d)


class _AllToAll(torch.autograd.Function):
    """One all-to-all whose backward is its inverse (``seq_to_heads`` <-> ``heads_to_seq``)."""

    @staticmethod
    def forward(ctx, x, group, forward_fn, backward_fn):
        ctx.group, ctx.backward_fn = group, backward_fn
        return forward_fn(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def seq_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``[s, b, h, d]`` sequence shard -> ``[P*s, b, h/P, d]``: every rank's tokens, this rank's heads.

    The output sequence is the group's shards concatenated in group-rank order.
    """
    return _AllToAll.apply(x, group, _seq_to_heads, _heads_to_seq)


def heads_to_seq(y: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Inverse of ``seq_to_heads``: ``[P*s, b, h/P, d] -> [s, b, h, d]``."""
    return _AllToAll.apply(y, group, _heads_to_seq, _seq_to_heads)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        p = dist.get_world_size(group)
        out = x.new_empty((p * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        comm_stats.record("all_gather", dict.fromkeys(_others(group), _nbytes(x)))
        return out

    @staticmethod
    def backward(ctx, grad):
        p = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // p,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        comm_stats.record("reduce_scatter", dict.fromkeys(_others(ctx.group), _nbytes(grad) // p))
        return out, None


def gather_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather ``x [s, ...]`` along dim 0 in group-rank order (backward: reduce-scatter)."""
    return _GatherSeq.apply(x, group)




class _GatherAmong(torch.autograd.Function):
    """All-gather among ``peers`` (global ranks of ``group``, in gather order; this rank is ``peers[me]``)
    by point-to-point transfers; backward sends each peer the gradient of its rows and sums what
    arrives (a reduce-scatter). Bytes are recorded as ``all_gather`` / ``reduce_scatter``."""

    @staticmethod
    def forward(ctx, x, peers, me, group):
        ctx.peers, ctx.me, ctx.group = peers, me, group
        x = x.contiguous()
        parts = [x if i == me else torch.empty_like(x) for i in range(len(peers))]
        _exchange_parts({p: x for i, p in enumerate(peers) if i != me},
                        {p: parts[i] for i, p in enumerate(peers) if i != me}, group, "all_gather")
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[0] // len(ctx.peers)
        grad = grad.contiguous()
        received = {p: grad.new_empty((n,) + tuple(grad.shape[1:])) for i, p in enumerate(ctx.peers) if i != ctx.me}
        _exchange_parts({p: grad[i * n:(i + 1) * n] for i, p in enumerate(ctx.peers) if i != ctx.me}, received,
                        ctx.group, "reduce_scatter")
        out = grad[ctx.me * n:(ctx.me + 1) * n].clone()
        for part in received.values():
            out += part
        return out, None, None, None


def _exchange_parts(sends: dict, recvs: dict, group: ProcessGroup, op: str) -> None:
    """Send and receive every part at once and wait (``PeerExchange`` names the peers on failure)."""
    PeerExchange(sends, recvs, group, op).start(0).wait()


def gather_seq_among(x: torch.Tensor, peers: Sequence[int], me: int, group: ProcessGroup) -> torch.Tensor:
    """All-gather ``x [s, ...]`` along dim 0 among the global ranks ``peers`` of ``group`` (this rank is
    ``peers[me]``), in ``peers`` order; backward: reduce-scatter among the same ranks."""
    return _GatherAmong.apply(x, list(peers), me, group)
