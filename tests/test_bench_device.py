"""The device benchmark on the CPU (``--device-bench cpu``, a smoke run of the path): it bounds the math
kernel's O(s^2) micro-benchmark and writes every result as it is measured; its GPU-only branch rehearsed with
CUDA's timing calls answered on the host; the picks tool and the GPU report over real and rehearsed rows."""
from __future__ import annotations

import contextlib
import json
import time
import warnings
from typing import Iterator

import pytest
import torch

from tools.bench_attention import main as bench_main
from tools.bench_cpu import Shape
from tools.bench_device import append_jsonl, device_benchmarks, math_block_bytes
from tools.rank_step import harness

CPU = torch.device("cpu")


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_math_bound_admits_32k_and_refuses_the_block_that_ran_out_of_memory():
    """32 heads on an 80 GB H100, bound = half its memory: S/P = 4096 (32K over 8) fits; 12288 (where the
    micro-benchmark ran out of memory) and 16384 (128K over 8) do not."""
    h100_half = 80 * 10**9 // 2
    assert math_block_bytes(1, 32, 4096) <= h100_half
    assert math_block_bytes(1, 32, 12288) > h100_half and math_block_bytes(1, 32, 16384) > h100_half
    assert math_block_bytes(2, 8, 100) == 5 * 4 * 2 * 8 * 100 * 100


def test_math_micro_benchmark_is_skipped_over_the_bound_with_the_reason(tmp_path):
    sink = append_jsonl(str(tmp_path / "r.jsonl"))
    result = device_benchmarks(CPU, Shape(64, 1, 2, 2, 8), (2,), reps=1, sink=sink, math_budget_bytes=1000)
    math_row = next(r for r in result["kernels"] if r["kernel"] == "math")
    assert "fwd_tflops" not in math_row and "over the bound of" in math_row["skipped"], math_row
    cpu_flash = next(r for r in result["kernels"] if r["kernel"] == "torch:cpu_flash")
    assert cpu_flash["fwd_tflops"] > 0  # the other kernels still run


def test_results_are_on_disk_before_a_later_failure(tmp_path):
    """P = 3 cannot split 64 tokens in zigzag: the run raises there, and every kernel row and the P = 2 row
    measured before are already in the file."""
    path = tmp_path / "r.jsonl"
    with pytest.raises(ValueError, match="not divisible by 2\\*cp=6"):
        device_benchmarks(CPU, Shape(64, 1, 2, 2, 8), (2, 3), reps=1, sink=append_jsonl(str(path)))
    records = _lines(path)
    assert {r["kernel"] for r in records if r["part"] == "kernel"} >= {"math", "torch:cpu_flash"}
    assert [r["world_size"] for r in records if r["part"] == "rank_schedule"] == [2]


def test_bench_attention_writes_the_jsonl_and_the_json(tmp_path):
    status = bench_main(["--no-cpu", "--device-bench", "cpu", "--seq-len", "64", "--world-sizes", "2",
                         "--heads", "2", "--kv-heads", "2", "--head-dim", "8", "--reps", "1", "--out", str(tmp_path)])
    assert status == 0
    records = _lines(tmp_path / "bench_attention_p2.jsonl")
    assert [r["part"] for r in records][0] == "machine" and records[-1]["part"] == "rank_schedule"
    summary = json.loads((tmp_path / "bench_attention_p2.json").read_text())
    row = summary["device"][0]["rank_schedule"][0]
    assert row["fwd_bwd"]["efficiency"] > 0
    assert "side_stream_gain" not in row["fwd_bwd"]  # on CPU the step runs in order: nothing to compare
    assert row["comm"] == "p2p" and row["harness"] == harness() == 5  # walked over its own K/V, one call a task, merges folded


def test_bench_picks_times_each_pick_with_its_own_hierarchy_and_skips_what_is_over_the_budget(tmp_path):
    """tools/bench_picks.py on CPU (a smoke run): each grid cell's pick runs with the pick's hierarchy
    ([4, 2] is an all-to-all over 4, not the benchmark's default 2), its efficiency beside the predicted
    ones (compute, and the step bounded by the host's issue time); a cell over --max-tflop is listed as
    skipped with the reason."""
    from tools.bench_picks import main as picks_main

    cell = {"model": "llama3_8b", "fused_equal_flops_ms": 1.0, "compute_ms": 1.25, "efficiency": 0.7}
    rows = [dict(cell, seq_len=256, cp=8, pick="cp4x2 a2a+p2p zigzag", comm="a2a+p2p", sizes=[4, 2], host_ms=2.0),
            dict(cell, seq_len=256, cp=8, pick="cp8 p2p zigzag", comm="p2p", sizes=[8]),
            dict(cell, seq_len=1048576, cp=8, pick="cp8 all_gather zigzag", comm="all_gather", sizes=[8])]
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"profile": "test", "rows": rows}))
    out = tmp_path / "picks.jsonl"
    assert picks_main(["--grid", str(grid), "--device", "cpu", "--reps", "1", "--out", str(out)]) == 0
    picks = [r for r in _lines(out) if r["part"] == "pick"]
    assert [r["sizes"] for r in picks] == [[4, 2], [8], [8]]
    assert picks[0]["step"]["sizes"] == [4, 2] and picks[0]["step"]["heads_on_rank"] == 8  # 32 heads over 4
    assert all(r["efficiency"] > 0 and r["predicted_compute_efficiency"] == 0.8 for r in picks[:2])
    # a step is the longer of its compute and the host's issue time (the grid's host_ms; none in an older grid)
    assert picks[0]["predicted_step_efficiency"] == 0.5 and picks[1]["predicted_step_efficiency"] == 0.8
    assert picks[0]["measured_over_predicted"] == picks[0]["efficiency"] / 0.5
    assert "skipped" in picks[2] and "over --max-tflop" in picks[2]["skipped"] and "efficiency" not in picks[2]


def test_the_gpu_report_reads_a_real_run_and_says_which_targets_it_meets(tmp_path):
    """tools/gpu_report.py over the H200's 128K benchmark lines (docs/gpu/) and a step summary: the table has
    every scheme measured, and the targets read 0.97 for p2p at 128K/P8 (not met: >= 0.98), 32K not
    measured, p2p's peak memory (0.92x: met) and the other schemes' highest beside it (all_gather's 1.74x)."""
    import shutil

    from tools.gpu_report import report

    (tmp_path / "bench").mkdir()
    shutil.copy("docs/gpu/h200_run2_bench_128k.jsonl", tmp_path / "bench" / "bench_attention_p8_gpu_checks.jsonl")
    (tmp_path / "summary.jsonl").write_text(json.dumps({"step": "4_picks", "rc": 124, "seconds": 100,
                                                        "timeout_s": 100, "log": "x"}) + "\n")
    text = report(str(tmp_path))
    assert "NVIDIA H200" in text and "| 4_picks | 124 (timed out) | 100 | 100 |" in text
    assert "| 128K / 8 | p2p | 8 | 0.93 | **0.97** |" in text and "| 128K / 8 | a2a | 1 |" in text
    assert "p2p fwd+bwd at 128K/P8: 0.970: not met (>= 0.98)" in text
    assert "p2p fwd+bwd at 32K/P8: not measured" in text
    assert "p2p's peak memory (the target's 1.03x was p2p's), highest of 1 steps: 0.92" in text and ": met (<= 1.0)" in text
    assert "all_gather 1.74x" in text


def test_the_gpu_report_shows_the_step_with_the_host_ahead(tmp_path):
    """A GPU run's step timed with the host ahead (``bench_device._queued_once``) is reported beside the cold
    one: its efficiency ('*' where the host still fell behind the hold), the host's issue time and the count
    of host-device synchronisations, and the p2p targets are judged on both."""
    from tools.gpu_report import report

    line = json.loads(next(x for x in open("docs/gpu/h200_run2_bench_128k.jsonl")
                           if '"rank_schedule"' in x and '"comm": "p2p"' in x))
    line["fwd_bwd"].update(queued_efficiency=0.991, host_ahead=False, host_issue_s=[0.0021, 0.0019, 0.0020],
                           host_syncs=["called a synchronizing CUDA operation"])
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "bench_attention_p8_x.jsonl").write_text(json.dumps(line) + "\n")
    text = report(str(tmp_path))
    assert "| 128K / 8 | p2p | 8 | 0.93 | **0.97** | 0.99* | - | 2.00 | 1 |" in text, text
    assert "p2p fwd+bwd at 128K/P8: 0.970: not met (>= 0.98); host ahead 0.991: met (>= 0.98)" in text


class _HostEvent:
    """A CUDA event answered on the host (``perf_counter``): the control-flow rehearsal below."""

    def __init__(self, enable_timing: bool = False):
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def elapsed_time(self, other) -> float:
        return (other.at - self.at) * 1e3


@contextlib.contextmanager
def cuda_timing_on_host() -> Iterator[None]:
    """CUDA's event, sleep and synchronise answered on the host while inside (a tool's GPU branch rehearsed on
    CPU tensors), and the sleep rate the host answered forgotten after: it is not a GPU's."""
    from tools import bench_device

    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"Event": _HostEvent, "synchronize": lambda *a: None,
                            "_sleep": lambda cycles: time.sleep(cycles / 1e9)}.items():
            mp.setattr(torch.cuda, name, value)
        bench_device._sleep_cycles_per_second.cache_clear()
        try:
            yield
        finally:
            bench_device._sleep_cycles_per_second.cache_clear()


def _gpu_branch_row(monkeypatch, capture) -> tuple[dict, list]:
    """A p2p 1K/P8 row through the benchmark's GPU branch on CPU tensors, CUDA's event, sleep, synchronise,
    sync-debug and memory calls answered on the host and the step graph's capture by ``capture``; and the
    sync-debug mode the branch left behind."""
    from tools import bench_device
    from mcp_context.algorithms.graphs import StepGraphs
    from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel

    mode = [0]
    for name, value in {"Event": _HostEvent, "synchronize": lambda *a: None,
                        "_sleep": lambda cycles: time.sleep(cycles / 1e9),
                        "get_sync_debug_mode": lambda: mode[0], "set_sync_debug_mode": lambda m: mode.__setitem__(0, m),
                        "reset_peak_memory_stats": lambda *a: None, "memory_allocated": lambda *a: 0,
                        "max_memory_allocated": lambda *a: 1 << 20}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(StepGraphs, "_cuda_graph", lambda self, run, static: capture(run, static))
    g = torch.Generator().manual_seed(0)
    row = {"part": "rank_schedule", "world_size": 8, "comm": "p2p", "seq_len": 1024}
    bench_device._sleep_cycles_per_second.cache_clear()
    try:
        bench_device.schedule_row(row, torch.device("cuda"), TorchKernel(FUSED_OPS["cpu_flash"]),
                                  lambda *size: torch.randn(*size, generator=g), Shape(1024, 1, 4, 2, 16), reps=2)
    finally:
        bench_device._sleep_cycles_per_second.cache_clear()  # the rate the host answered is not a GPU's
    return row, mode


def test_the_gpu_branch_of_a_rank_step_row_runs_and_feeds_the_report(monkeypatch, tmp_path):
    """What the benchmark runs only on a GPU (the other stream choice's timing, the step with the host ahead and
    replayed from a graph, the sync count, peak memory), rehearsed on CPU tensors (``_gpu_branch_row``, the capture by
    ``test_graphs.rerun``), so an error in that branch shows here and not on a lent GPU. The figures mean
    nothing; checked: the row has every field ``tools/gpu_report.py`` reads, the report renders it, and a
    synchronising call is counted."""
    from tools import bench_device
    from tools.gpu_report import report
    from tests.test_graphs import rerun

    row, mode = _gpu_branch_row(monkeypatch, rerun)
    fb = row["fwd_bwd"]
    assert {"queued_efficiency", "queued_side_stream_gain", "host_issue_s", "fused_host_issue_s", "host_ahead", "host_syncs", "side_stream_gain",
            "in_order_peak_bytes", "memory_ratio", "graphed_s", "graphed_efficiency", "graphed_peak_bytes"} <= set(fb), \
        sorted(fb)
    assert fb["graphs_in_training"] is False  # a p2p ring: the engine does not capture its transfers
    # calls this short ship their work in order, so the step timed beside them is the side stream's: the gain
    # compares the two choices whichever ships (it was the shipped step against itself at short calls)
    assert fb["side_stream_ships"] is False and fb["in_order_s"] == fb["ours_s"] != fb["side_stream_s"]
    assert len(fb["queued_s"]) == len(fb["host_issue_s"]) == len(fb["fused_host_issue_s"]) == 2 and fb["host_syncs"] == [] and mode[0] == 0
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "bench_attention_p8_x.jsonl").write_text(json.dumps(row) + "\n")
    text = report(str(tmp_path))
    assert "| 1K / 8 | p2p | 8 |" in text and f"| {fb['graphed_efficiency']:.2f}† |" in text, text

    def syncing():
        warnings.warn("called a synchronizing CUDA operation")
    assert bench_device._host_syncs(syncing) == ["called a synchronizing CUDA operation"] and mode[0] == 0


def test_a_graph_capture_that_fails_is_the_rows_note_and_the_rest_is_timed(monkeypatch, tmp_path, capsys):
    """A capture can fail on a GPU (a2a+p2p's at 16 and 64 ranks did on an H200, run 5): one that raises leaves
    the row's other figures measured, names the failure in the row (``graphed_error``) and in the report's graphed
    column, and prints its whole traceback (a capture invalidated by an earlier op fails at a later one)."""
    from tools.gpu_report import report
    from tests.test_graphs import failing_capture

    row, _ = _gpu_branch_row(monkeypatch, failing_capture)
    assert row["graphed_error"] == "RuntimeError: operation not permitted when stream is capturing"
    err = capsys.readouterr().err
    assert "the graphed step's capture failed (p2p, sizes [8]); its traceback:" in err and "Traceback" in err, err
    assert "queued_efficiency" in row["fwd_bwd"] and "graphed_s" not in row["fwd_bwd"]
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "bench_attention_p8_x.jsonl").write_text(json.dumps(row) + "\n")
    assert "| failed: RuntimeError: operation not permitted when stream is capturing |" in report(str(tmp_path))


def test_the_gpu_report_judges_the_picks_cold_and_with_the_host_ahead(tmp_path):
    """A pick's row shows its fwd+bwd timed cold, with the host ahead ('*' where the host still fell behind) and
    replayed from CUDA graphs ('†' for a ring, which the engine does not capture), and the pick target is judged
    on each (graphed: over the picks the engine captures): a cell whose GPU idles for a host that issues tiny
    calls reads low cold and may be at the fused call's rate in training."""
    from tools.gpu_report import report

    def pick(cp, comm, cold, ahead, kept_up, graphed):
        return {"part": "pick", "model": "llama3_8b", "seq_len": 32768, "cp": cp, "pick": f"cp{cp} {comm} zigzag",
                "efficiency": cold, "predicted_compute_efficiency": 0.98, "measured_over_predicted": cold / 0.98,
                "step": {"fwd_bwd": {"queued_efficiency": ahead, "host_ahead": kept_up, "graphed_efficiency": graphed,
                                     "graphs_in_training": comm != "p2p"}}}
    rows = [pick(8, "p2p", 0.97, 1.01, True, 0.99), pick(64, "a2a", 0.26, 0.99, False, 0.96)]
    (tmp_path / "picks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report(str(tmp_path))
    assert "| llama3_8b | 32K | 64 | cp64 a2a zigzag | **0.26** | 0.99* | 0.96 | 0.98 | - | 0.27 |" in text, text
    assert "| llama3_8b | 32K | 8 | cp8 p2p zigzag | **0.97** | 1.01 | 0.99† | 0.98 | - | 0.99 |" in text, text
    assert ("the planner's pick, lowest of 2 cells measured: 0.260: not met (>= 0.95); host ahead, lowest of 2: "
            "0.990: met (>= 0.95); replayed from CUDA graphs (step_graphs, the 1 picks whose K/V are local to the "
            "step), lowest: 0.960: met (>= 0.95)") in text, text


def test_the_gpu_report_reads_run_4s_picks_and_p2p_step(tmp_path):
    """tools/gpu_report.py over the H200's run 4 (docs/gpu/h200_run4_*): the picks table shows each cell cold and
    with the host ahead, and the targets read 32K/P8 p2p 0.74 cold (not met) and 0.86 with the host ahead (met),
    the picks' lowest 0.36 cold and 0.77 with the host ahead (32K over 64 ranks: not met)."""
    import shutil

    from tools.gpu_report import report

    (tmp_path / "bench").mkdir()
    shutil.copy("docs/gpu/h200_run4_bench_32k.jsonl", tmp_path / "bench" / "bench_attention_p8_gpu_checks.jsonl")
    shutil.copy("docs/gpu/h200_run4_picks.jsonl", tmp_path / "picks.jsonl")
    text = report(str(tmp_path))
    assert "| llama3_8b | 32K | 64 | cp8x8 a2a+all_gather zigzag | **0.36** | 0.77 | - | 0.98 | - | 0.37 |" in text, text
    assert "p2p fwd+bwd at 32K/P8: 0.736: not met (>= 0.85); host ahead 0.857: met (>= 0.85)" in text, text
    assert ("the planner's pick, lowest of 11 cells measured: 0.361: not met (>= 0.95); host ahead, lowest of 11: "
            "0.775: not met (>= 0.95)") in text, text


def test_the_gpu_report_sets_the_measured_busy_share_beside_the_occupancy_model(tmp_path):
    """profile.jsonl's occupancy rows (tools/kernel_rates.py) become a table: per block and head count, the busy
    share measured (FLOP rate per head over 32 heads') and the model's; here the times are built from the model
    at 4 and 32 heads for one block, so both columns read the model's 64/132 forward and 1 backward."""
    from mcp_context.masks import FULL_BLOCK
    from mcp_context.plan import load_profile
    from mcp_context.plan.cost import occupancy
    from mcp_context.schedule import BlockTask
    from tools.gpu_report import report

    h200 = load_profile("h200_nvlink_ib")
    rows = [{"part": "profile", "comm": "p2p", "seq_len": 32768, "cp": 8}]
    for heads in (4, 32):
        fwd, bwd = occupancy(h200, BlockTask((0, 2048), (0, 30720), FULL_BLOCK), heads)
        rows.append({"part": "occupancy", "rows": 2048, "keys": 30720, "mask": "full", "heads": heads,
                     "fwd_s": [1.0], "fwd_bwd_s": [1.0], "queued_fwd_s": [heads * 1e-4 / fwd],
                     "queued_fwd_bwd_s": [heads * (1e-4 / fwd + 3e-4 / bwd)]})
    (tmp_path / "profile.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report(str(tmp_path))
    assert "## Calls too small to fill the GPU" in text, text
    assert "| full 2048x30720 | 4 | 0.48 | 0.48 | 1.00 | 1.00 |" in text, text
    assert "| full 2048x30720 | 32 | 1.00 | 1.00 | 1.00 | 1.00 |" in text, text


def test_the_report_tables_the_varlen_rows_of_the_profile(tmp_path):
    """``kernel_rates.py --parts varlen`` rows in profile.jsonl become the report's table of a packed step's ways
    (per task, per task with flash, one variable-length call per mask kind); a profile without them adds none."""
    from tools.gpu_report import varlen_table

    rows = [{"part": "varlen", "step": 0, "tasks": 42, "way": way, "calls": calls, "cold_ms": cold,
             "host_ahead_ms": 0.5, "host_issue_ms": issue, "host_ahead": ahead, "max_diff_from_per_task": diff}
            for way, calls, cold, issue, ahead, diff in (("per_task", 42, 4.1, 4.0, False, 0.0),
                                                         ("varlen_flash", 2, 0.9, 0.3, True, 7.8e-3))]
    path = tmp_path / "profile.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"part": "profile"}] + rows))
    table = varlen_table(str(path))
    assert table[2] == "| 0 (42) | per_task | 42 | 4.10 | 0.50* | 4.00 | 0.0e+00 |"
    assert table[3] == "| 0 (42) | varlen_flash | 2 | 0.90 | 0.50 | 0.30 | 7.8e-03 |" and len(table) == 4
    path.write_text(json.dumps({"part": "profile"}) + "\n")
    assert varlen_table(str(path)) == []


def test_the_report_tables_the_window_rows_of_the_profile(tmp_path):
    """``kernel_rates.py --parts window`` rows in profile.jsonl become the report's table of a window's two ways:
    cold, with the host ahead ('*' where the host fell behind), the host's issue time and the largest
    differences of out, dq, dk and dv from the shipped step's; no window rows, no table."""
    from tools.gpu_report import window_table

    diff = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    rows = [{"part": "window", "window": 127, "way": "shipped", "cold_ms": 3.2, "host_ahead_ms": 1.1,
             "host_issue_ms": 3.0, "host_ahead": False, "max_diff_from_shipped": diff},
            {"part": "window", "window": 127, "way": "flash_window", "cold_ms": 0.4, "host_ahead_ms": 0.3,
             "host_issue_ms": 0.1, "host_ahead": True,
             "max_diff_from_shipped": {"out": 7.8e-3, "dq": 1.6e-2, "dk": 3.1e-2, "dv": 1.6e-2}}]
    path = tmp_path / "profile.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"part": "profile"}] + rows))
    table = window_table(str(path))
    assert table[2] == "| 127 | shipped | 3.20 | 1.10* | 3.00 | 0.0e+00 / 0.0e+00 / 0.0e+00 / 0.0e+00 |"
    assert table[3] == "| 127 | flash_window | 0.40 | 0.30 | 0.10 | 7.8e-03 / 1.6e-02 / 3.1e-02 / 1.6e-02 |"
    assert len(table) == 4
    path.write_text(json.dumps({"part": "profile"}) + "\n")
    assert window_table(str(path)) == []
