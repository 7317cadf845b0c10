"""``selftest.inprocess``: CP ranks as threads, and transfers that do not match named, not hung.

The package's own comm primitives run on every thread; each case is a fault a real run would meet as a
gloo/NCCL error or a hang, and must be an ``ExchangeError`` naming the ranks and the call (at once, not
after a timeout: every case here finishes in well under a second).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from mcp_context.comm import RingExchange, gather_seq, seq_to_heads
from mcp_context.selftest.inprocess import ExchangeError, SimGroup, run_ranks

WORLD = SimGroup(range(4))


def test_the_package_primitives_move_the_right_rows_between_threads():
    """All-to-all (seq -> heads), all-gather and a ring step, exact (integers in fp64)."""
    def rank_fn(rank: int):
        x = torch.arange(8.0).view(2, 1, 4, 1) + 100 * rank     # [s=2, b, h=4, d]: rank r's rows
        heads = seq_to_heads(x, WORLD)                           # every rank's 2 rows, head `rank`
        gathered = gather_seq(torch.full((1,), float(rank)), WORLD)
        ring = RingExchange(list(range(4)), rank, WORLD, "ring_kv")
        received = ring.start(torch.full((2,), float(rank)), step=0).wait()
        return heads.flatten().tolist(), gathered.tolist(), received.tolist()

    for rank, (heads, gathered, received) in enumerate(run_ranks(4, rank_fn)):
        assert heads == [100 * r + 4 * s + rank for r in range(4) for s in range(2)]
        assert gathered == [0.0, 1.0, 2.0, 3.0]
        assert received == [float((rank - 1) % 4)] * 2


def test_a_send_of_the_wrong_size_names_the_ranks_and_the_transfer():
    """Rank 1 sends 3 rows and expects 3 (its buffer is shaped like its send): rank 2 or rank 1 finds it."""
    def rank_fn(rank: int):
        ring = RingExchange(list(range(4)), rank, WORLD, "ring_kv")
        send = torch.zeros(3 if rank == 1 else 2)
        return ring.start(send, step=0).wait()

    with pytest.raises(ExchangeError, match=r"ring_kv ring step 0: rank (2|1) .*transfer 0 from rank (1|0) to rank "
                                            r"(2|1): rank \d sends \[(3|2)\] torch.float32, rank \d expects \[(2|3)\]"):
        run_ranks(4, rank_fn)


def test_a_send_to_oneself_is_named():
    def rank_fn(rank: int):
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.zeros(1), rank, WORLD)])

    with pytest.raises(ExchangeError, match=r"rank \d sends to itself"):
        run_ranks(4, rank_fn)


def test_members_at_different_collectives_are_named():
    def rank_fn(rank: int):
        x = torch.zeros(4 if rank == 3 else 8)
        dist.all_reduce(x, group=WORLD)

    with pytest.raises(ExchangeError, match=r"call 0: the members differ .*rank 3: all_reduce of \[4\]"):
        run_ranks(4, rank_fn)


def test_ranks_that_all_wait_are_stopped_at_once_naming_what_each_waits_for():
    def rank_fn(rank: int):
        if rank == 0:
            return None  # never joins the all-reduce the others wait in
        dist.all_reduce(torch.zeros(1), group=WORLD)

    start = time.monotonic()
    with pytest.raises(ExchangeError, match=r"every rank still running waits and none can go on: rank 1 waits for SimGroup"):
        run_ranks(4, rank_fn)
    assert time.monotonic() - start < 5.0


def test_a_send_nobody_receives_fails_the_run():
    def rank_fn(rank: int):
        if rank == 0:
            dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.zeros(1), 1, WORLD)])

    with pytest.raises(ExchangeError, match=r"rank 0's transfer 0 to rank 1 was never received"):
        run_ranks(4, rank_fn)


def test_torch_distributed_is_itself_again_after_a_run():
    functions = {name: getattr(dist, name) for name in ("all_reduce", "get_rank", "batch_isend_irecv", "P2POp")}
    with pytest.raises(ExchangeError):
        run_ranks(2, lambda rank: dist.all_reduce(torch.zeros(rank + 1), group=SimGroup(range(2))))
    assert {name: getattr(dist, name) for name in functions} == functions


def test_an_initialized_world_makes_its_groups_and_a_plain_one_refuses_to():
    """``initialized=True`` (dynamic CP's start-up groups, megatron-core's modules): ``dist.is_initialized()``
    and ``dist.new_group`` answer as in a process group, and the groups made carry collectives; without it
    ``new_group`` raises (the engine must be handed its groups)."""
    def rank_fn(rank: int):
        pair = dist.new_group([rank // 2 * 2, rank // 2 * 2 + 1])
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=pair)
        return dist.is_initialized(), pair.ranks, float(x)

    is_initialized = dist.is_initialized
    assert run_ranks(4, rank_fn, initialized=True) == [(True, (0, 1), 1.0), (True, (0, 1), 1.0),
                                                       (True, (2, 3), 5.0), (True, (2, 3), 5.0)]
    with pytest.raises(RuntimeError, match="the in-process world builds no groups"):
        run_ranks(2, rank_fn)
    assert dist.is_initialized is is_initialized
