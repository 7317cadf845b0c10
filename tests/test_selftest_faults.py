"""The self-test never passes a broken build: real faults planted in the package, both modes fail.

Each fault is planted by swapping the code of one package function in place (``planted``: every
reference to the function, a table's included, runs the faulty code) for one run of the self-test,
then put back. Planted: two CP ranks' zigzag chunks swapped in ``layouts.layout_spans`` (dense, MoE and
MLA tiny recipes, and the dynamic-CP one, whose step of documents over groups of 2 and 4 ranks it puts
off), the loss averaged per rank in ``masked_token_mean``, the all-to-all output left out of position
order (``schemes._member_pieces``), and the a2a+all_gather gather over the outer members in the wrong
order (``schemes._gathered_kv``). Every run must exit 1 with the named check failed, with
``--simulate`` (one process) and across 4 gloo ranks (the worker pool, the fault planted in every
worker). The gather fault must be a named failure before any engine call, not a gloo error.
"""
from __future__ import annotations

import contextlib
import types
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from mcp_context import api, layouts
from mcp_context.algorithms import schemes
from mcp_context.megatron import batch
from mcp_context.schedule import forget_kept_schedules
from tests._dist import run_distributed
from tests.test_selftest import _rows, _run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def planted(fn: Callable, faulty: Callable) -> Iterator[None]:
    """``fn`` runs ``faulty``'s code wherever it is referenced; ``faulty`` resolves names in ``fn``'s
    module and reaches the original as ``_planted_original``. The engines ``engine_for`` keeps per group
    and the schedules ``layout_schedule`` keeps are dropped on the way in and out: one made before the plant
    would not run it, and one made under it would keep what it resolved there (a worker's next case over the
    same group would inherit the fault)."""
    original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    fn.__globals__["_planted_original"] = original
    code = fn.__code__
    fn.__code__ = faulty.__code__
    _forget_resolved()
    try:
        yield
    finally:
        fn.__code__ = code
        del fn.__globals__["_planted_original"]
        _forget_resolved()


def _forget_resolved() -> None:
    api._engine.cache_clear()
    forget_kept_schedules()


# The faults, each written as the faulty version of the package function (names resolve in its module).

def _zigzag_ranks_0_and_1_swapped(layout, cp_size, cp_rank, seq_len, documents=None):
    if layout == "zigzag" and cp_size > 1 and cp_rank in (0, 1):
        cp_rank = 1 - cp_rank
    return _planted_original(layout, cp_size, cp_rank, seq_len, documents)  # noqa: F821


def _loss_averaged_per_rank(per_token_loss, loss_mask, group):
    mask = loss_mask.to(per_token_loss.dtype)
    local_mean = (per_token_loss * mask).sum() / mask.sum().clamp(min=1)
    size = dist.get_world_size(group) if group is not None else 1  # noqa: F821
    mean = local_mean.detach().clone()
    if size > 1:
        dist.all_reduce(mean, group=group)  # noqa: F821
    return local_mean / size, mean / size


def _a2a_output_not_reordered(layout, cp_size, seq_len, inner, member, documents=None):
    return None


def _gather_peers_reversed(groups, schedule, member, peers, *rest):
    return _planted_original(groups, schedule, member, peers[::-1], *rest)  # noqa: F821


FAULTS = {
    "layout-swap": (layouts.layout_spans, _zigzag_ranks_0_and_1_swapped),
    "loss-per-rank": (batch.masked_token_mean, _loss_averaged_per_rank),
    "a2a-order": (schemes._member_pieces, _a2a_output_not_reordered),
    "gather-order": (schemes._gathered_kv, _gather_peers_reversed),
}

RUN = ["--hcp-sizes", "2,2", "--seq-len", "256", "--dtype", "fp64", "--repeats", "1"]
RECIPE = {name: ["--recipe", str(ROOT / "recipes" / f"{name}.yaml"), "--seq-len", "256", "--dtype", "fp64",
                 "--repeats", "1"] for name in ("tiny_cpu", "tiny_mixtral_cpu", "tiny_mla_cpu", "tiny_dynamic_cp_cpu")}
# case: (fault, argv, check that must fail simulated, check that must fail across ranks)
CASES = {
    "layout-swap-dense": ("layout-swap", RECIPE["tiny_cpu"], "boundaries.layout", "boundaries.layout"),
    "layout-swap-moe": ("layout-swap", RECIPE["tiny_mixtral_cpu"], "boundaries.layout", "boundaries.layout"),
    "layout-swap-mla": ("layout-swap", RECIPE["tiny_mla_cpu"], "boundaries.layout", "boundaries.layout"),
    "layout-swap-dynamic": ("layout-swap", RECIPE["tiny_dynamic_cp_cpu"], "dynamic.step", "dynamic.step"),
    "loss-per-rank": ("loss-per-rank", RUN, "boundaries.loss", "boundaries.loss"),
    "a2a-order": ("a2a-order", RUN, "exchange[causal]", "attention[causal] fp64"),
    "gather-order": ("gather-order", RUN + ["--comm", "a2a+all_gather"], "exchange[causal]", "exchange[causal]"),
}


def _planted_run(fault: str, argv: list[str]) -> tuple[int, str]:
    with planted(*FAULTS[fault]):
        return _run(argv)


def _planted_main(rank: int, world: int, fault: str, argv: list[str]) -> tuple[int, str]:
    status, text = _planted_run(fault, argv)
    return status, text if rank == 0 else ""


def _assert_dynamic_step_off_by_numbers(text: str) -> None:
    """The swap shows in the numbers of the groups of several ranks (one-rank groups hold no chunk to swap)."""
    row = next(line for line in text.splitlines() if line.startswith("dynamic.step"))
    assert "per-token loss error" in row and "on groups of [2, 4] ranks" in row and "gradients off" in row, row


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_planted_fault_fails_simulated(case):
    fault, argv, caught_by, _ = CASES[case]
    status, text = _planted_run(fault, ["--simulate", *argv])
    assert status == 1 and _rows(text).get(caught_by) == "FAIL", text
    if case == "layout-swap-dynamic":
        _assert_dynamic_step_off_by_numbers(text)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_planted_fault_fails_across_four_gloo_ranks(case):
    fault, argv, _, caught_by = CASES[case]
    results = run_distributed(4, _planted_main, fault, argv)
    text = results[0][1]
    assert [status for status, _ in results] == [1] * 4 and _rows(text).get(caught_by) == "FAIL", text
    if fault == "gather-order":  # a named failure before any engine call, not gloo's "Pair is not connected"
        assert "sends to itself" in text and "not run: the transfers do not match" in text, text
        assert "Gloo" not in text and "Pair" not in text, text
    if fault == "layout-swap":  # the model's layer (dense, MoE, MLA) at CP 4 against CP 1 sees it too
        layer = next(name for name in _rows(text) if name.startswith("boundaries.layer["))
        assert _rows(text)[layer] == "FAIL", text
    if case == "layout-swap-dynamic":
        _assert_dynamic_step_off_by_numbers(text)


def test_the_plants_are_undone():
    """After a planted run the package is itself again: the same run passes."""
    with planted(*FAULTS["layout-swap"]):
        assert layouts.layout_spans("zigzag", 4, 0, 64)[0].start == 8
    assert layouts.layout_spans("zigzag", 4, 0, 64)[0].start == 0
    status, text = _run(["--simulate", *RUN])
    assert status == 0, text


def _main_on_rank(rank: int, world: int, argv: list[str]) -> tuple[int, str]:
    status, text = _run(argv)
    return status, text if rank == 0 else ""


def test_a_layer_the_check_cannot_build_fails_the_run_unless_accepted():
    """MLA head dims from flags (no recipe to build the MLA layer from) across 4 ranks: the layer row
    says it did not run and the exit status is 1; with --allow-unchecked the row is accepted, status 0."""
    argv = ["--comm", "p2p", "--seq-len", "64", "--dtype", "fp64", "--repeats", "1", "--head-dim", "24",
            "--v-head-dim", "16"]
    refused, accepted = (run_distributed(4, _main_on_rank, argv + extra)[0] for extra in ([], ["--allow-unchecked"]))
    row = "boundaries.layer[causal+mla:24/16]"
    assert refused[0] == 1 and _rows(refused[1])[row] == "NOT RUN", refused[1]
    assert "--v-head-dim without a recipe" in refused[1], refused[1]
    assert refused[1].strip().endswith("passed, 0 failed, 1 not run"), refused[1]
    assert accepted[0] == 0 and _rows(accepted[1])[row] == "accepted", accepted[1]


def test_a_plant_after_a_clean_run_of_the_same_recipe_is_still_caught():
    """A clean run first keeps its schedules (``layout_schedule``'s cache) and engines; the plant drops them, so
    the faulty layout is what the next run resolves and the dynamic step fails (without dropping the
    schedules, the dynamic step ran the clean schedule and passed: a CI run, test order)."""
    status, text = _run(["--simulate", *RECIPE["tiny_dynamic_cp_cpu"]])
    assert status == 0, text
    status, text = _planted_run("layout-swap", ["--simulate", *RECIPE["tiny_dynamic_cp_cpu"]])
    assert status == 1 and _rows(text).get("dynamic.step") == "FAIL", text
    _assert_dynamic_step_off_by_numbers(text)
