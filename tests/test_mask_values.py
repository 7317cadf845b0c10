"""The mask as a value at the public API, and a packing parsed once per step.

``context_parallel_attention(..., mask=...)`` with ``SlidingWindow``/``Full``/``Causal`` or a
``documents_mask`` value gives exactly what the ``causal``/``window_size``/``cu_seqlens`` conveniences
give (bitwise: the same engine work); conflicting arguments are refused. A ``Documents`` value built
once is reused by every call with no parse of the offsets (counted), and ranks that were handed
different packings still all raise the same error. Engines are shared per configuration.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from tests._dist import run_distributed
from tests.reference import random_qkv
from tests.test_packed import packing


@contextlib.contextmanager
def counting_calls(owner, name: str):
    """Count the calls of ``owner.name`` inside the block (the count is ``[n]``, read after it)."""
    original, count = getattr(owner, name), [0]

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counting)
    try:
        yield count
    finally:
        setattr(owner, name, original)


def _same_results(rank, world):
    from mcp_context import (Causal, Full, SlidingWindow, build_hcp_groups, context_parallel_attention,
                             documents_mask, shard_sequence)

    groups = build_hcp_groups([2, 2])
    q, k, v, _ = random_qkv(12 * world, 2, 8, 2, 8, seed=3)
    local = [shard_sequence(x, world, rank, "zigzag", dim=0) for x in (q, k, v)]
    pairs = [
        (dict(causal=True, window_size=(5, 0)), dict(mask=SlidingWindow(5, 0))),
        (dict(causal=False), dict(mask=Full())),
        (dict(causal=True), dict(mask=Causal())),
        (dict(causal=False, window_size=(3, 4)), dict(mask=SlidingWindow(3, 4))),
    ]
    diffs = [(context_parallel_attention(*local, groups, comm="a2a+p2p", **a)
              - context_parallel_attention(*local, groups, comm="a2a+p2p", **b)).abs().max().item() for a, b in pairs]
    cu, padded, seq_len = packing(world, "balanced")
    cu_t, padded_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)
    q, k, v, _ = random_qkv(seq_len, 1, 8, 2, 8, seed=4)
    local = [shard_sequence(x, world, rank, "balanced", 0, cu_t, padded_t) for x in (q, k, v)]
    by_offsets = context_parallel_attention(*local, groups, comm="p2p", layout="balanced", window_size=(3, 0),
                                            cu_seqlens=cu_t, cu_seqlens_padded=padded_t)
    by_value = context_parallel_attention(*local, groups, comm="p2p", layout="balanced",
                                          mask=documents_mask(cu_t, padded_t, within=SlidingWindow(3, 0)))
    diffs.append((by_offsets - by_value).abs().max().item())
    return diffs


def test_mask_values_give_the_same_results_as_the_convenience_arguments():
    for rank, diffs in enumerate(run_distributed(4, _same_results)):
        assert diffs == [0.0] * len(diffs), (rank, diffs)


def _parses(rank, world):
    from mcp_context import build_hcp_groups, documents_mask, engine_for, shard_sequence
    from mcp_context import masks

    cu, padded, seq_len = packing(world, "zigzag")
    documents = documents_mask(cu, padded, seq_len=seq_len)  # once per step
    q, k, v, _ = random_qkv(seq_len, 1, 4, 2, 8, seed=5)
    local = [shard_sequence(x, world, rank, "zigzag", 0, torch.tensor(cu), torch.tensor(padded)) for x in (q, k, v)]
    groups = build_hcp_groups([world])
    with counting_calls(masks, "_offsets") as parses:
        layers = [engine_for(groups, comm="p2p", layout="zigzag") for _ in range(8)]  # 8 layers, one config
        for engine in layers:
            engine(*local, documents=documents)
    return parses[0], len({id(e) for e in layers})


def test_a_documents_value_is_parsed_once_and_engines_are_shared_by_layers():
    for rank, (parses, engines) in enumerate(run_distributed(2, _parses)):
        assert parses == 0, rank  # the offsets were parsed when the value was built, not per layer
        assert engines == 1, rank


def _disagree(rank, world):
    from mcp_context import build_hcp_groups, documents_mask, engine_for

    cu, padded, seq_len = packing(world, "zigzag")
    if rank == 1:
        cu = cu[:2] + [cu[2] + 1] + cu[3:]
    q = torch.zeros(seq_len // world, 1, 4, 8, dtype=torch.float64)
    try:
        engine_for(build_hcp_groups([world]), comm="p2p")(q, q, q, documents=documents_mask(cu, padded))
    except ValueError as err:
        return str(err)
    return None


def test_ranks_with_different_documents_values_all_raise_the_same_error():
    messages = run_distributed(2, _disagree)
    assert messages[0] is not None and messages[0] == messages[1]
    assert "cu_seqlens differ" in messages[0]


def _conflicts(rank, world, case):
    from mcp_context import SlidingWindow, build_hcp_groups, context_parallel_attention, documents_mask

    q = torch.zeros(8, 1, 4, 8, dtype=torch.float64)
    kwargs = {"window": dict(mask=SlidingWindow(3, 0), window_size=(3, 0)),
              "documents": dict(mask=documents_mask([0, 8]), cu_seqlens=torch.tensor([0, 8], dtype=torch.int32)),
              "type": dict(mask="causal")}[case]
    try:
        context_parallel_attention(q, q, q, build_hcp_groups([1]), comm="p2p", **kwargs)
    except (TypeError, ValueError) as err:
        return str(err)
    return None


@pytest.mark.parametrize("case,words", [("window", ["mask=", "window_size=", "not both"]),
                                        ("documents", ["mask=Documents", "cu_seqlens", "not both"]),
                                        ("type", ["mask='causal'", "SlidingWindow"])])
def test_conflicting_mask_arguments_are_refused(case, words):
    message = run_distributed(1, _conflicts, case)[0]
    assert message is not None
    for word in words:
        assert word in message, (word, message)


def _unchecked_disagreement(rank, world, as_value):
    from mcp_context import ContextParallelAttention, build_hcp_groups, documents_mask

    cu, padded, seq_len = packing(world, "zigzag")
    if rank == 1:
        cu = cu[:2] + [cu[2] + 1] + cu[3:]
    q = torch.zeros(seq_len // world, 1, 4, 8, dtype=torch.float64)
    engine = ContextParallelAttention(build_hcp_groups([world]), comm="p2p", check_ranks=False)  # NCCL's default
    packed = (dict(documents=documents_mask(cu, padded)) if as_value else
              dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32), cu_seqlens_padded=torch.tensor(padded)))
    try:
        engine(q, q, q, **packed)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("as_value", [True, False], ids=["documents", "cu_seqlens"])
def test_the_packing_check_is_on_even_when_the_rank_check_is_off(as_value):
    messages = run_distributed(2, _unchecked_disagreement, as_value)
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert "cu_seqlens differ" in messages[0]


def _agreed_once(rank, world):
    from mcp_context import ContextParallelAttention, build_hcp_groups, documents_mask
    from mcp_context.engine import agree_on_documents
    import torch.distributed as dist

    cu, padded, seq_len = packing(world, "zigzag")
    groups = build_hcp_groups([world])
    documents = agree_on_documents(documents_mask(cu, padded), groups)  # the step's one check
    q = torch.zeros(seq_len // world, 1, 4, 8, dtype=torch.float64)
    engine = ContextParallelAttention(groups, comm="p2p", check_ranks=False)
    with counting_calls(dist, "all_reduce") as all_reduces:
        for _ in range(4):  # four layers
            engine(q, q, q, documents=documents)
    return all_reduces[0]


def test_an_agreed_documents_value_costs_no_check_per_layer():
    assert run_distributed(2, _agreed_once) == [0, 0]
