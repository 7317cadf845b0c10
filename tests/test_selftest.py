"""``python -m mcp_context.selftest``: it passes where CP is right and fails, naming the check, where it is not.

Passing (CPU, fp64 within 1e-10 * max(1, max|ref|), fp32 within 1e-5 * max(1, max|ref|); bf16 within
1.5 * sqrt(blocks) * max(one fused call's error, u * max|ref|)):
- every recipe in recipes/ at its own CP layout, scaled down with --seq-len, with --simulate;
- CP=8 [2, 2, 2] with --simulate for sinks, MLA head dims, windowed layers and packed documents;
- CP=4 [2, 2] (the tiny dense, MoE and MLA+MoE recipes), CP=4 p2p with sinks, windowed and full layers
  and packed documents, and CP=4 p2p with MLA head dims from flags, across 4 gloo ranks, through the
  same ``main`` a torchrun launch calls; with the model's transformer layer (dense, MoE, MLA) at CP=4
  against CP=1 for each attention kind (MLA head dims from flags: no layer to build, accepted with
  --allow-unchecked);
- the dynamic-CP recipe (simulated at every layout, and across 4 gloo ranks with a2a+p2p [2, 2]): its
  step of documents on groups of every size against each document alone (``dynamic.step``).
Failing: each planted fault (data sliced in another layout, a wrong softmax scale on one rank, a
dropped sink, another cu_seqlens on one rank, a dynamic-CP document in another group on one rank)
exits 1 naming the check that caught it, simulated and across ranks. The 4-rank cases run ``main`` in
the gloo worker pool (a torchrun launch costs ~45 s on the 2-core machine; the README's sample output
is such a launch).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcp_context.selftest.__main__ import main
from mcp_context.selftest.reference import document_ids, reference_attention
from mcp_context.selftest.setup import document_mix, model_kinds
from tests._dist import run_distributed
from tests.reference import full_attention

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the tiny blocks here are slower with more on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(argv: list[str]) -> tuple[int, str]:
    """``main(argv)`` on the CPU (also where CUDA is present: these are the CPU checks), its status and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv + ["--no-progress", "--device", "cpu"])
    return status, out.getvalue() + err.getvalue()


def _rows(text: str) -> dict[str, str]:
    """``{check name: 'pass' | 'FAIL' | 'NOT RUN' | 'accepted'}`` from the table."""
    rows = {}
    for line in text.splitlines():
        row = re.match(r"(\S.*?) {2,}(pass|FAIL|NOT RUN|accepted)( {2,}|$)", line)
        if row:
            rows[row.group(1)] = row.group(2)
    return rows


def _assert_all_pass(status: int, text: str) -> None:
    assert status == 0, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("selftest: ") and last.endswith(" passed, 0 failed"), text
    assert "attention[" in text and "boundaries.loss" in text and "plan.bytes[" in text, text


LAYOUTS = {"own": [], "cp4-hcp": ["--hcp-sizes", "2,2", "--comm", "a2a+p2p"], "cp4-p2p": ["--cp-size", "4",
           "--hcp-sizes", "4", "--comm", "p2p"], "cp8-hcp": ["--hcp-sizes", "2,2,2", "--comm", "a2a+p2p"]}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_passes_simulated(recipe, layout):
    """At the recipe's own CP layout and at CP=4 [2, 2], CP=4 p2p and CP=8 [2, 2, 2]. A dynamic-CP recipe's own
    layout is its data parallel group (4 ranks); at every layout its step of documents on groups of every size
    passes against each document alone (``dynamic.step``, every rank a thread)."""
    status, text = _run(["--simulate", "--recipe", str(recipe), "--seq-len", "256", "--dtype", "fp64",
                         "--repeats", "1", *LAYOUTS[layout]])
    _assert_all_pass(status, text)
    if "hybrid_context_parallel: true" in recipe.read_text():
        world = 8 if layout == "cp8-hcp" else 4
        sizes = ", ".join(str(n) for n in (1, 2, 4, 8) if n <= world)
        assert _rows(text)["dynamic.step"] == "pass" and f"on groups of {sizes} of {world} ranks" in text, text


CONFIGS = {
    "sinks": ["--softmax-type", "learnable"],
    "mla": ["--head-dim", "24", "--v-head-dim", "16"],
    "window": ["--window", "9,0", "--window-attn-skip-freq", "2"],
    "packed": ["--packed", "--softmax-type", "off-by-one"],
}


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_attention_configurations_pass_simulated_at_cp8_hierarchical(config):
    status, text = _run(["--simulate", "--hcp-sizes", "2,2,2", "--seq-len", "128", "--dtype", "fp64,fp32",
                         "--heads", "8", "--kv-heads", "2", "--head-dim", "16", *CONFIGS[config]])
    _assert_all_pass(status, text)
    if config == "window":  # both kinds of layer: the windowed ones and every second one in full
        assert "attention[window(9,0)] fp64" in text and "attention[causal] fp64" in text


def test_half_precision_is_held_to_one_fused_call_and_prints_the_ratio(tmp_path):
    """bf16 on the CPU's fused op: the path a GPU run takes, with the ratio and bound in the JSON."""
    path = tmp_path / "bf16.json"
    status, text = _run(["--simulate", "--cp-size", "4", "--seq-len", "256", "--dtype", "bf16", "--json", str(path)])
    _assert_all_pass(status, text)
    doc = json.loads(path.read_text())
    check = next(c for c in doc["checks"] if c["name"] == "attention[causal] bf16")
    for name in ("out", "dq", "dk", "dv"):
        figure = check["figures"]["outputs"][name]
        assert 0 < figure["error"] <= figure["bound"] and figure["fused_error"] > 0 and figure["blocks"] >= 1
    assert "x fused" in text


def test_json_holds_every_check_and_the_counts(tmp_path):
    path = tmp_path / "out.json"
    status, text = _run(["--simulate", "--seq-len", "64", "--dtype", "fp64", "--json", str(path)])
    doc = json.loads(path.read_text())
    assert status == 0 and doc["failed"] == 0 and doc["passed"] == len(doc["checks"]) == len(_rows(text))
    bytes_check = next(c for c in doc["checks"] if c["name"].startswith("plan.bytes"))
    assert bytes_check["figures"]["sent"][0] == bytes_check["figures"]["analytic"]


FAULT_CASES = [
    ("layout-mismatch", [], "attention[causal] fp64"),
    ("wrong-scale", [], "attention[causal] fp64"),
    ("dropped-sink", ["--softmax-type", "learnable"], "attention[causal+sinks:learnable] fp64"),
    ("cu-seqlens-differ", ["--packed"], "plan.agreement"),
    ("dynamic-group-moved", ["--recipe", str(ROOT / "recipes" / "tiny_dynamic_cp_cpu.yaml"), "--comm", "a2a+p2p"],
     "dynamic.step"),
]


@pytest.mark.parametrize("fault,flags,caught_by", FAULT_CASES, ids=[f for f, _, _ in FAULT_CASES])
def test_a_planted_fault_fails_simulated_naming_the_check(fault, flags, caught_by):
    status, text = _run(["--simulate", "--hcp-sizes", "2,2", "--seq-len", "64", "--dtype", "fp64", "--plant", fault,
                         *flags])
    rows = _rows(text)
    assert status == 1 and rows[caught_by] == "FAIL", text
    assert text.strip().splitlines()[-1].endswith(f"{sum(v == 'FAIL' for v in rows.values())} failed")
    assert rows["boundaries.unslice"] == "pass"  # a fault in the attention does not smear over other checks
    if fault == "dynamic-group-moved":  # every rank's plan is checked before any collective: rank 1's is named
        assert "ranks [1] disagree with the other ranks on the dynamic-CP schedule" in text, text


def _distributed_main(rank, world, argv):
    status, text = _run(argv)
    if "Gloo connectFullMesh failed" in text:  # the machine's, not the check's: the pool reruns the case
        raise RuntimeError(text)
    return status, text if rank == 0 else ""


DISTRIBUTED = {
    "cp4-hcp-tiny-recipe": ["--recipe", str(ROOT / "recipes" / "tiny_cpu.yaml"), "--seq-len", "128"],
    "cp4-p2p-tiny-recipe": ["--recipe", str(ROOT / "recipes" / "tiny_cpu.yaml"), "model.cp_comm_type=p2p",
                            "model.hierarchical_context_parallel_sizes=null", "--seq-len", "64", "--dtype", "fp64"],
    "cp4-p2p-sinks-window-packed": ["--comm", "p2p", "--seq-len", "128", "--dtype", "fp64", "--head-dim", "16",
                                    "--softmax-type", "learnable", "--window", "15,0", "--window-attn-skip-freq", "2",
                                    "--packed"],
    "cp4-hcp-moe-recipe": ["--recipe", str(ROOT / "recipes" / "tiny_mixtral_cpu.yaml"), "--seq-len", "64", "--dtype",
                           "fp64", "--repeats", "1"],
    "cp4-hcp-mla-moe-recipe": ["--recipe", str(ROOT / "recipes" / "tiny_mla_cpu.yaml"), "--seq-len", "64",
                               "--dtype", "fp64", "--repeats", "1"],
    "cp4-p2p-mla": ["--comm", "p2p", "--seq-len", "64", "--dtype", "fp64", "--head-dim", "24", "--v-head-dim", "16",
                    "--allow-unchecked"],
    "dynamic-hcp-recipe": ["--recipe", str(ROOT / "recipes" / "tiny_dynamic_cp_cpu.yaml"), "model.cp_comm_type=a2a+p2p",
                           "model.hierarchical_context_parallel_sizes=[2,2]", "--seq-len", "128", "--dtype", "fp64",
                           "--repeats", "1"],
}


@pytest.mark.parametrize("case", DISTRIBUTED, ids=list(DISTRIBUTED))
def test_passes_across_four_gloo_ranks(case):
    results = run_distributed(4, _distributed_main, DISTRIBUTED[case])
    assert [status for status, _ in results] == [0] * 4, results[0][1]
    status, text = results[0]
    if case == "cp4-p2p-mla":  # MLA head dims from flags: no MLA layer to build, listed and accepted
        assert status == 0 and text.strip().endswith("passed, 0 failed, 1 not run (accepted with --allow-unchecked)")
        assert _rows(text)["boundaries.layer[causal+mla:24/16]"] == "accepted", text
        return
    _assert_all_pass(status, text)
    assert "(trace, every rank)" in text
    layer_rows = {name: v for name, v in _rows(text).items() if name.startswith("boundaries.layer[")}
    assert layer_rows and set(layer_rows.values()) == {"pass"}  # the model's layer per kind against CP=1
    if case == "dynamic-hcp-recipe":  # the fixed checks at the whole group, and a step on groups of 1, 2 and 4
        assert _rows(text)["dynamic.step"] == "pass" and "on groups of 1, 2, 4 of 4 ranks" in text, text


@pytest.mark.parametrize("fault,flags,caught_by", FAULT_CASES, ids=[f for f, _, _ in FAULT_CASES])
def test_a_planted_fault_fails_across_ranks_naming_the_check(fault, flags, caught_by):
    results = run_distributed(4, _distributed_main, ["--hcp-sizes", "2,2", "--seq-len", "64", "--dtype", "fp64",
                                                     "--repeats", "1", "--plant", fault, *flags])
    assert [status for status, _ in results] == [1] * 4, results[0][1]
    assert _rows(results[0][1])[caught_by] == "FAIL", results[0][1]
    if fault == "dropped-sink":  # the engine's own agreement check names the disagreement
        assert "softmax_offset presence" in results[0][1]
    if fault == "layout-mismatch":  # the layer's hidden states are sliced the wrong way too
        assert _rows(results[0][1])["boundaries.layer[causal]"] == "FAIL", results[0][1]
    if fault == "dynamic-group-moved":  # refused on every rank before the step's first collective, not a hang
        assert "ranks [1] disagree with the other ranks on the dynamic-CP schedule" in results[0][1], results[0][1]


def test_table_on_stdout_progress_on_stderr_summary_last():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["--simulate", "--seq-len", "32", "--dtype", "fp64", "--repeats", "1", "--plant", "wrong-scale",
                       "--device", "cpu"])
    assert status == 1
    assert out.getvalue().strip().splitlines()[-1] == "selftest: 7 passed, 2 failed", out.getvalue()
    assert "selftest: plan agreement: ok" in err.getvalue() and "attention[causal] fp64: FAIL" in err.getvalue()
    assert "selftest: 7 passed" not in err.getvalue()


def test_the_module_entry_exits_with_mains_status():
    """``python -m mcp_context.selftest`` exits with ``main``'s status (2 here: no process group and no
    --simulate, refused with the fix before anything heavy is imported)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "mcp_context.selftest", "--cp-size", "4"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--simulate" in proc.stderr and "torchrun" in proc.stderr, proc.stderr


def test_hierarchical_comm_without_levels_is_refused_not_silently_flat():
    """Upstream trains a2a+p2p without hierarchical sizes with no CP at all (Megatron-Bridge #2667)."""
    status, text = _run(["--simulate", "--comm", "a2a+p2p", "--cp-size", "4"])
    assert status == 2 and "--hcp-sizes" in text
    status, text = _run(["--simulate", "--recipe", str(ROOT / "recipes" / "tiny_cpu.yaml"),
                         "model.hierarchical_context_parallel_sizes=null"])
    assert status == 2 and "hierarchical_context_parallel_sizes" in text


def test_model_kinds_follow_window_attn_skip_freq():
    assert [k.window for k in model_kinds(None, None, "vanilla", False)] == [None]
    assert [k.window for k in model_kinds([7, 0], None, "vanilla", False)] == [(7, 0)]
    assert [k.window for k in model_kinds([7, 0], 2, "vanilla", False)] == [(7, 0), None]
    assert [k.window for k in model_kinds([7, 0], [1, 1, 0], "learnable", True)] == [(7, 0), None]
    assert all(k.sink and k.packed for k in model_kinds([7, 0], [1, 0], "learnable", True))


def test_document_mix_is_a_realistic_padded_packing():
    cu, padded = document_mix(4096, 16, seed=3)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    spans = [b - a for a, b in zip(padded, padded[1:])]
    assert padded[-1] == 4096 and all(s % 16 == 0 for s in spans)
    assert all(0 < n <= s < n + 16 for n, s in zip(lengths, spans))
    assert max(spans) >= 0.4 * 4096 - 16 and len(lengths) >= 8 and min(lengths) < 100


def test_the_chunked_reference_equals_the_tests_independent_reference():
    """The self-test's own reference (query chunks, sinks, windows, documents) against tests/reference.py."""
    gen = torch.Generator().manual_seed(0)
    s, h, kv = 48, 4, 2
    q, k, v, dout = (torch.randn(s, 1, n, 8, generator=gen, dtype=torch.float64) for n in (h, kv, kv, h))
    sink = torch.randn(h, generator=gen, dtype=torch.float64)
    cu, padded = [0, 10, 30, 41], [0, 16, 32, 48]
    docs = document_ids(s, cu, padded)
    got = reference_attention(q, k, v, dout, 0.3, (5, 0), docs, sink, chunk=7)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    out, lse = full_attention(*leaves[:3], True, 0.3, (5, 0), docs, leaves[3])
    out.backward(dout)
    expected = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad,
                "dsink": leaves[3].grad}
    for name, ref in expected.items():
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(got[name])), name
        assert torch.allclose(got[name][finite], ref.detach()[finite], atol=1e-12, rtol=0), name


def test_the_boundary_checks_catch_global_positions_and_per_rank_averages():
    """Not vacuous: packed positions that do not restart per document, and a loss averaged per rank
    first (a rank with few valid tokens weighs too much), are both reported."""
    from mcp_context.selftest import boundaries
    from mcp_context.selftest.setup import AttentionKind, Setup, with_documents

    setup = with_documents(Setup(4, (4,), "p2p", "zigzag", 128, 1, 4, 2, 8, 8, (AttentionKind(packed=True),),
                                 (torch.float64,)))
    batch, _ = boundaries.full_batch(setup, packed=True)
    assert boundaries.check_positions(setup, {"position_ids": batch["position_ids"]}, packed=True) == []
    global_positions = {"position_ids": torch.arange(setup.seq_len)[None]}
    assert boundaries.check_positions(setup, global_positions, packed=True)
    loss, mask = batch["per_token_loss"][0], batch["loss_mask"][0].double()
    mask[:100] = 0  # most valid tokens on the last quarter: per-rank means differ from the global one
    batch["loss_mask"] = mask[None]
    quarters = [(loss[i:i + 32], mask[i:i + 32]) for i in range(0, 128, 32)]
    per_rank_first = sum(float((l * m).sum() / m.sum().clamp(min=1)) for l, m in quarters) / 4
    problems, _ = boundaries.check_loss([(per_rank_first / 4, per_rank_first)] * 4, batch)
    assert len(problems) == 2, problems


REFUSED = {
    "heads-not-split-by-a2a": (["--heads", "5", "--kv-heads", "5", "--hcp-sizes", "2,2"], "--heads=5"),
    "heads-not-divisible-by-kv": (["--heads", "8", "--kv-heads", "3"], "--heads 8 is not divisible by --kv-heads 3"),
    "gqa-uneven": (["--heads", "6", "--kv-heads", "4"], "--kv-heads 4"),
    "kv-heads-not-split-by-a2a": (["--heads", "12", "--kv-heads", "6", "--hcp-sizes", "4", "--comm", "a2a"],
                                  "--kv-heads=6"),
    "missing-recipe": (["--recipe", "/nonexistent.yaml"], "--recipe /nonexistent.yaml: no such file"),
    "negative-hcp-sizes": (["--hcp-sizes", "-2,2"], "--hcp-sizes -2,2 must be positive"),
    "zero-seq-len": (["--seq-len", "0"], "--seq-len 0 must be a positive integer"),
    "balanced-unpacked": (["--layout", "balanced"], "--layout balanced"),
    "dynamic-fault-without-dynamic-cp": (["--plant", "dynamic-group-moved"], "--plant dynamic-group-moved needs"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_flags_that_cannot_run_are_refused_up_front_naming_the_flag(case):
    """Exit 2 and one line naming the flag and its value (and a fix: 'e.g.', 'choose', 'use', 'add'),
    before any check runs."""
    argv, named = REFUSED[case]
    status, text = _run(["--simulate", *argv])
    lines = text.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], text
    assert any(fix in lines[0] for fix in ("e.g.", "choose", "use ", "add ")), text


def test_a_negative_window_value_parses_after_the_flag():
    """``--window -1,0`` (unbounded left) is a value, not a flag; here it is a plain causal mask."""
    status, text = _run(["--simulate", "--window", "-1,0", "--seq-len", "32", "--dtype", "fp64", "--repeats", "1"])
    _assert_all_pass(status, text)


LAYOUT_RUNS = {
    "striped": ["--layout", "striped"], "contiguous": ["--layout", "contiguous"],
    "striped-packed": ["--layout", "striped", "--packed"], "balanced-packed": ["--layout", "balanced", "--packed"],
    "zigzag-packed": ["--packed"],
}


@pytest.mark.parametrize("layout", LAYOUT_RUNS, ids=list(LAYOUT_RUNS))
def test_every_layout_passes_simulated_held_to_its_definition(layout):
    status, text = _run(["--simulate", "--comm", "p2p", "--cp-size", "4", "--seq-len", "64", "--dtype", "fp64",
                         "--repeats", "1", "--head-dim", "16", *LAYOUT_RUNS[layout]])
    _assert_all_pass(status, text)
    assert _rows(text)["boundaries.layout"] == "pass" and _rows(text)["exchange[causal" + (
        "+packed]" if "--packed" in LAYOUT_RUNS[layout] else "]")] == "pass", text


def test_the_layout_definitions_are_the_written_out_rows_and_megatron_cores():
    """``layout_truth`` against rows written out by hand (CP 2, S 8), and megatron-core's RoPE slice."""
    from mcp_context.selftest.layout_truth import expected_positions, expected_rows, megatron_rope_positions

    cpu = torch.device("cpu")
    assert [expected_rows("zigzag", 2, r, 8) for r in (0, 1)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [expected_rows("contiguous", 2, r, 8) for r in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [expected_rows("striped", 2, r, 8) for r in (0, 1)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    padded = [0, 8, 12]  # two documents of 8 and 4 padded rows
    assert [expected_rows("zigzag", 2, r, 12, padded) for r in (0, 1)] == [[0, 1, 6, 7, 8, 11], [2, 3, 4, 5, 9, 10]]
    assert expected_positions([0, 1, 6, 7, 8, 11], padded) == [0, 1, 6, 7, 0, 3]
    assert expected_rows("balanced", 2, 0, 12, padded) is None
    assert [megatron_rope_positions(8, 2, r, cpu) for r in (0, 1)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert megatron_rope_positions(12, 2, 0, cpu, padded) == [0, 1, 6, 7, 0, 3]


def test_a_dynamic_recipe_with_a_cp_size_other_than_the_world_is_told_to_drop_it():
    """A dynamic-CP recipe's checks run over every launched rank, so the fix for a --cp-size that differs from
    the world is to drop the flag, not to set model.context_parallel_size (1 under dynamic CP)."""
    from mcp_context.selftest.__main__ import _parser, build_setup

    args = _parser().parse_args(["--recipe", str(ROOT / "recipes" / "tiny_dynamic_cp_cpu.yaml"), "--cp-size", "4"])
    with pytest.raises(ValueError, match="the world has 2 ranks but the CP size is 4") as refused:
        build_setup(args, world_size=2)  # as under torchrun --nproc-per-node 2
    assert "drop --cp-size" in str(refused.value) and "model.context_parallel_size" not in str(refused.value)
