"""tools/host_costs.py on CPU (a smoke run: the figures mean nothing here, the GPU run is what it is for):
every variant of every case is timed and the profile's groups add up to its total."""
import json

import pytest
import torch

from mcp_context import merge
from tools.host_costs import main, parse_case, variants


def test_each_variant_is_timed_and_the_profile_groups_add_up(tmp_path):
    out = tmp_path / "runs" / "host.jsonl"
    out.parent.mkdir()
    out.write_text('{"part": "host_costs", "comm": "from an earlier run"}\n')  # replaced, not appended to
    assert main(["--device", "cpu", "--cases", "p2p:256:4", "a2a+all_gather:256:4:2", "--heads", "4", "--kv-heads",
                 "2", "--head-dim", "16", "--reps", "1", "--profile-steps", "2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["comm"] for r in rows} == {"p2p", "a2a+all_gather"}
    names = list(variants())
    assert names == ["shipped", "eager:merge", "eager:dq_sum", "eager:dkv_add", "eager:dkv_first_write",
                     "through_dynamo", "in_order", "side_stream"]
    for comm, sizes in (("p2p", [4]), ("a2a+all_gather", [2, 2])):
        mine = [r for r in rows if r["comm"] == comm]
        timed = [r for r in mine if "profile" not in r]
        assert [r["variant"] for r in timed] == names + ["fused"] and all(r["cold_ms"] > 0 for r in timed)
        assert all(r["sizes"] == sizes and "host_issue_ms" not in r for r in mine)  # no GPU: nothing held busy
        (prof,) = [r["profile"] for r in mine if "profile" in r]
        assert [r["runtime_api"] for r in mine if "profile" in r] == [{}]  # no CUDA calls on the CPU
        ms = prof["ms_per_step"]
        assert min(ms.values()) >= 0 and ms["total"] > 0
        assert ms["fused_regions"] + ms["attention_ops"] + ms["autograd_engine"] + ms["rest"] == pytest.approx(ms["total"])
    p2p_profile = next(r["profile"] for r in rows if r["comm"] == "p2p" and "profile" in r)
    assert p2p_profile["fused_region_calls_per_step"] > 0 and p2p_profile["ms_per_step"]["attention_ops"] > 0


def test_a_region_run_eagerly_compiles_again_after_the_block_even_if_it_raised():
    region = merge.FUSED_REGIONS["dkv_add"]
    with pytest.raises(RuntimeError):
        with region.eagerly():
            assert not region.compiling
            raise RuntimeError("inside")
    assert region.compiling


@pytest.mark.parametrize("text", ["p2p:32768", "p2p:32K:8", "p2p:1:2:3:4"])
def test_a_malformed_case_is_refused_naming_it(text):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match=text):
        parse_case(text)


def test_the_gpu_report_shows_each_variant_against_the_shipped_step(tmp_path):
    from tools.gpu_report import report

    base = {"part": "host_costs", "device": "cuda:0", "comm": "p2p", "seq_len": 32768, "cp": 8, "sizes": [8],
            "attention_calls": 8, "heads_on_rank": 32}
    rows = [dict(base, variant="shipped", cold_ms=9.5, host_ahead_ms=8.0, host_issue_ms=8.0, host_ahead=True),
            dict(base, variant="eager:dkv_add", cold_ms=9.0, host_ahead_ms=8.1, host_issue_ms=7.2, host_ahead=False),
            dict(base, variant="shipped", profile={"ms_per_step": {"fused_regions": 4.1, "attention_ops": 1.1,
                                                                   "autograd_engine": 0.5, "rest": 3.2, "total": 8.9},
                                                   "fused_region_calls_per_step": 17})]
    (tmp_path / "host_costs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report(str(tmp_path))
    assert "| p2p 32K/8 | eager:dkv_add | 9.00 | 8.10* | 7.20 | 0.90 |" in text, text
    assert "| p2p 32K/8 | 4.10 | 1.10 | 0.50 | 3.20 | 8.90 | 17 |" in text, text


@pytest.mark.parametrize("broken", [False, True])
def test_the_gpu_branch_runs_on_cpu_tensors_with_cudas_timing_calls_answered_on_the_host(monkeypatch, tmp_path,
                                                                                          broken):
    """What runs only on a GPU (the step with the host ahead, the host issue time, the synchronise after the
    profile), rehearsed as tests/test_bench_device.py rehearses the benchmark's: CPU tensors, CUDA's event,
    sleep and synchronise answered on the host, the step graph's capture by ``test_graphs.rerun``. Checked:
    each variant's row (and the graphed step's) has the fields gpu_report reads; a capture that raises (not yet
    run on a GPU) is the graphed row's error, shown in the report, and every other variant is still timed."""
    import time

    import torch

    from mcp_context.algorithms.graphs import StepGraphs
    from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel
    from tests.test_bench_device import _HostEvent
    from tests.test_graphs import failing_capture, rerun
    from tools import bench_device
    from tools.host_costs import case_rows

    for name, value in {"Event": _HostEvent, "synchronize": lambda *a: None,
                        "_sleep": lambda cycles: time.sleep(cycles / 1e9)}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    capture = failing_capture if broken else rerun
    monkeypatch.setattr(StepGraphs, "_cuda_graph", lambda self, run, static: capture(run, static))
    g = torch.Generator().manual_seed(0)
    bench_device._sleep_cycles_per_second.cache_clear()
    try:
        rows = case_rows("p2p", 256, 4, 2, torch.device("cuda"), TorchKernel(FUSED_OPS["cpu_flash"]),
                         lambda *size: torch.randn(*size, generator=g), 4, 2, 16, reps=1, profile_steps=1)
    finally:
        bench_device._sleep_cycles_per_second.cache_clear()  # the rate the host answered is not a GPU's
    timed = [r for r in rows if "profile" not in r and "error" not in r]
    assert [r["variant"] for r in timed] == [*variants(), "fused"] + ([] if broken else ["graphed"])
    assert all({"host_ahead_ms", "host_issue_ms", "host_ahead", "cold_ms"} <= set(r) and r["device"] == "cuda"
               for r in timed)
    errors = [r for r in rows if "error" in r]
    assert [r["error"] for r in errors] == (["RuntimeError: operation not permitted when stream is capturing"]
                                            if broken else [])
    if broken:
        from tools.gpu_report import report

        (tmp_path / "host_costs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert "| graphed | failed: RuntimeError: operation not permitted when stream is capturing |" in report(str(tmp_path))


def test_the_runtime_profile_keeps_the_cuda_calls_longest_on_the_host_per_step():
    """``runtime_rows``: CUDA runtime and driver calls only (not aten ops, not cuDNN or CUTLASS kernels), per
    step, longest first, at most ``RUNTIME_CALLS_KEPT``; on the CPU the profile finds none."""
    from tools.host_costs import RUNTIME_CALLS_KEPT, runtime_calls, runtime_rows

    events = [("cudaLaunchKernel", 280, 1400.0), ("cudaMemcpyAsync", 4, 3000.0), ("aten::add_", 50, 900.0),
              ("cudnn_generated_fort_native_sdpa", 20, 0.0), ("cutlass_80_tensorop_gemm", 10, 0.0),
              ("cuLaunchKernel", 60, 300.0)] + [(f"cudaEventQuery{i}", 1, float(i)) for i in range(10)]
    rows = runtime_rows(events, 2)
    assert list(rows)[:3] == ["cudaMemcpyAsync", "cudaLaunchKernel", "cuLaunchKernel"]
    assert rows["cudaMemcpyAsync"] == {"calls": 2, "host_us": 1500.0} and len(rows) == RUNTIME_CALLS_KEPT
    assert runtime_calls(lambda: torch.ones(4).add_(1), 2, torch.device("cpu")) == {}


def test_the_gpu_report_lists_each_cases_runtime_calls(tmp_path):
    from tools.gpu_report import report

    row = {"part": "host_costs", "device": "cuda:0", "comm": "a2a", "seq_len": 32768, "cp": 8, "sizes": [8],
           "variant": "shipped", "profile": {"ms_per_step": {"fused_regions": 0.0, "attention_ops": 0.2,
                                                             "autograd_engine": 0.1, "rest": 0.3, "total": 0.6},
                                             "fused_region_calls_per_step": 0},
           "runtime_api": {"cudaMemcpyAsync": {"calls": 2.0, "host_us": 1500.0}}}
    (tmp_path / "host_costs.jsonl").write_text(json.dumps(row) + "\n")
    assert "| a2a 32K/8 | cudaMemcpyAsync 2x 1500 |" in report(str(tmp_path))


def test_the_bookkeeping_mode_times_the_step_with_no_work_in_its_ops_and_regions(tmp_path):
    """``--bookkeeping``: the ring step runs through its executor with attention ops that compute nothing (their
    outputs are uninitialised) and regions that return at once, so a row's time is the host's own work; the
    real regions are back afterwards. A GPU device is refused: the mode is for the CPU."""
    from tools.host_costs import NO_WORK

    out = tmp_path / "bookkeeping.jsonl"
    eager = {name: region.eager for name, region in merge.FUSED_REGIONS.items()}
    assert main(["--device", "cpu", "--bookkeeping", "--cases", "p2p:256:4", "a2a:64:4", "--heads", "4",
                 "--kv-heads", "2", "--head-dim", "8", "--profile-steps", "3", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["comm"], r["variant"], r["attention_calls"]) for r in rows] == [("p2p", "bookkeeping", 4),
                                                                            ("a2a", "bookkeeping", 1)]
    assert all(0 < r["host_ms"] <= r["host_ms_median"] for r in rows)
    assert {name: region.eager for name, region in merge.FUSED_REGIONS.items()} == eager
    q = torch.randn(1, 16, 4, 8).transpose(1, 2)  # [b, h, s, d] of token-major storage, as the executor's
    o, lse = NO_WORK.forward(q, q, q, True, 1.0)
    assert o.shape == q.shape and o.stride() == q.stride() and lse.shape == (1, 4, 16)
    with pytest.raises(SystemExit):
        main(["--device", "cuda", "--bookkeeping", "--out", str(out)])
