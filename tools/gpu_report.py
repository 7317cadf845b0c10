#!/usr/bin/env python
"""The results of ``make test-gpu`` as markdown, against issue 25's targets: what to paste into
``docs/performance.md`` and a closing note after a device loan.

Reads what ``tools/gpu_checks.sh`` leaves in its results folder, each part only if it is there (a run cut
short keeps the lines it wrote): ``summary.jsonl`` (each step's rc and seconds), the benchmark's JSON lines
(``bench/bench_attention_*.jsonl``: one rank's step of each scheme against one fused call of equal useful
FLOPs), ``picks.jsonl`` (``tools/bench_picks.py``: the planner's pick at each cell of its grid) and
``profile.jsonl``'s ``occupancy`` rows (``tools/kernel_rates.py``: calls of few heads against the planner's
occupancy model), ``host_costs.jsonl`` (``tools/host_costs.py``) and ``regions.jsonl`` (``tools/kernel_rates.py
--parts regions``, run after ``make test-gpu`` where device time is left: the merges' and sums' kernels).

    python tools/gpu_report.py runs/gpu_checks > runs/gpu_checks/report.md
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from typing import Iterator

TARGETS = {"p2p_32k_p8": 0.85, "p2p_128k_p8": 0.98, "pick": 0.95, "memory": 1.0}
"""Issue 25's targets: p2p zigzag fwd+bwd against one fused call at 32K/P8 and 128K/P8, the planner's pick
at every cell, and peak memory against the fused call."""


def _lines(path: str) -> Iterator[dict]:
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _k(n: int) -> str:
    return f"{n // 1048576}M" if n % 1048576 == 0 else f"{n // 1024}K"


def _case(r: dict) -> str:
    """A host-costs row's case: ``comm S/P``."""
    return f"{r['comm']} {_k(r['seq_len'])}/{r['cp']}"


def _held(value: float, host_ahead: bool) -> str:
    """A figure timed with the GPU held busy, ``*`` where the host fell behind the hold (the GPU waited for it)."""
    return f"{value:.2f}" + ("" if host_ahead else "*")


def steps_table(summary: str) -> list[str]:
    out = ["| step | rc | seconds | timeout |", "|---|---|---|---|"]
    for r in _lines(summary):
        rc = f"{r['rc']}" + (" (timed out)" if r["rc"] == 124 else "")
        out.append(f"| {r['step']} | {rc} | {r['seconds']} | {r['timeout_s']} |")
    return out


def bench_table(paths: list[str]) -> tuple[list[str], dict]:
    """The rank-step rows as a table, and the figures the targets read."""
    out = ["| S / P | scheme | calls | fwd | fwd+bwd | host ahead | graphed | host issue ms (fused) | syncs | vs fused at S/P | "
           "side stream gain | peak memory | in order |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    seen = {}
    for path in paths:
        for r in _lines(path):
            if r.get("part") == "machine":
                m = r["machine"]
                out.insert(0, f"{os.path.basename(path)}: {m.get('cuda') or 'no GPU'}, torch {m['torch']}, "
                              f"{m['time_utc']}, {r['reps']} repetitions (medians)\n")
            if r.get("part") != "rank_schedule" or "fwd_bwd" not in r:
                continue
            fb, f = r["fwd_bwd"], r["fwd"]
            sizes = "x".join(map(str, r.get("sizes", []))) if len(r.get("sizes", [])) > 1 else ""
            gain = f"{fb['side_stream_gain']:.3f}" if "side_stream_gain" in fb else "-"
            mem = f"{fb['memory_ratio']:.2f}x" if fb.get("memory_ratio") else "-"
            in_order = (f"{fb['in_order_peak_bytes'] / fb['fused_peak_bytes']:.2f}x"
                        if fb.get("in_order_peak_bytes") and fb.get("fused_peak_bytes") else "-")
            scheme = f"{r['comm']} {sizes}" if sizes else r["comm"]
            ahead = issue = syncs = "-"
            graphed = _graphed(fb, r.get("graphed_error", ""))
            if "queued_efficiency" in fb:
                ahead = _held(fb["queued_efficiency"], fb["host_ahead"])
                issue = f"{statistics.median(fb['host_issue_s']) * 1e3:.2f}" + (
                    f" ({statistics.median(fb['fused_host_issue_s']) * 1e3:.2f})" if "fused_host_issue_s" in fb else "")
                syncs = str(len(fb["host_syncs"]))
            out.append(f"| {_k(r['seq_len'])} / {r['world_size']} | {scheme} | {r['attention_calls']:g} | "
                       f"{f['efficiency']:.2f} | **{fb['efficiency']:.2f}** | {ahead} | {graphed} | {issue} | {syncs} | "
                       f"{fb['efficiency_vs_per_rank']:.2f} | {gain} | {mem} | {in_order} |")
            seen[(r["comm"], r["seq_len"], r["world_size"])] = fb
    return out, seen


def _step_prediction(r: dict) -> str:
    """The planner's prediction of the step with the host's issue time ('-' for a grid from before it)."""
    return f"{r['predicted_step_efficiency']:.2f}" if "predicted_step_efficiency" in r else "-"


def _graphed(fb: dict, error: str = "") -> str:
    """A step's figure replayed from CUDA graphs ('†': a ring, whose transfers the engine does not capture), or
    the capture's failure."""
    if error:
        return f"failed: {error}"
    if "graphed_efficiency" not in fb:
        return "-"
    return f"{fb['graphed_efficiency']:.2f}" + ("" if fb["graphs_in_training"] else "†")


def picks_table(path: str) -> tuple[list[str], list[float], list[float], list[float]]:
    """The picks as markdown, their cold fwd+bwd figures, their figures with the host ahead, and replayed from
    CUDA graphs where the engine would replay them (``step_graphs``)."""
    out = ["| model | S | P | pick | measured fwd+bwd | host ahead | graphed | predicted (compute) | predicted (step) | "
           "measured / predicted |", "|---|---|---|---|---|---|---|---|---|---|"]
    measured, ahead, graphed = [], [], []
    for r in _lines(path):
        if r.get("part") != "pick":
            continue
        if "skipped" in r:
            out.append(f"| {r['model']} | {_k(r['seq_len'])} | {r['cp']} | {r['pick']} | skipped: {r['skipped']} | - | - | "
                       f"{r['predicted_compute_efficiency']:.2f} | {_step_prediction(r)} | - |")
            continue
        if r.get("device", "cuda").startswith("cpu") and not out[0].startswith("(a CPU"):
            out.insert(0, "(a CPU smoke run: these figures mean nothing)\n")
        measured.append(r["efficiency"])
        fb = r.get("step", {}).get("fwd_bwd", {})
        if "queued_efficiency" in fb:
            ahead.append(fb["queued_efficiency"])
        if fb.get("graphs_in_training"):
            graphed.append(fb["graphed_efficiency"])
        queued = _held(fb["queued_efficiency"], fb["host_ahead"]) if "queued_efficiency" in fb else "-"
        out.append(f"| {r['model']} | {_k(r['seq_len'])} | {r['cp']} | {r['pick']} | **{r['efficiency']:.2f}** | "
                   f"{queued} | {_graphed(fb, r.get('step', {}).get('graphed_error', ''))} | "
                   f"{r['predicted_compute_efficiency']:.2f} | {_step_prediction(r)} | "
                   f"{r['measured_over_predicted']:.2f} |")
    return out, measured, ahead, graphed


def host_costs_table(path: str) -> list[str]:
    """``tools/host_costs.py``'s rows: each variant's step against the shipped one, then the host profile."""
    rows = list(_lines(path))
    out = ["| case | variant | cold ms | host ahead ms | host issue ms | host issue vs shipped |", "|---|---|---|---|---|---|"]
    shipped = {}
    for r in rows:
        case = _case(r)
        if "error" in r:
            out.append(f"| {case} | {r['variant']} | failed: {r['error']} | - | - | - |")
        if "profile" in r or "host_issue_ms" not in r:
            continue
        shipped.setdefault(case, r["host_issue_ms"])
        out.append(f"| {case} | {r['variant']} | {r['cold_ms']:.2f} | {_held(r['host_ahead_ms'], r['host_ahead'])} | "
                   f"{r['host_issue_ms']:.2f} | {r['host_issue_ms'] / shipped[case]:.2f} |")
    out += ["", "| case | host ms a step under cProfile: fused regions | attention ops | autograd engine | rest | "
                "total | fused region calls |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "profile" in r:
            ms = r["profile"]["ms_per_step"]
            out.append(f"| {_case(r)} | {ms['fused_regions']:.2f} | "
                       f"{ms['attention_ops']:.2f} | {ms['autograd_engine']:.2f} | {ms['rest']:.2f} | {ms['total']:.2f} | "
                       f"{r['profile']['fused_region_calls_per_step']:.0f} |")
    runtime = [r for r in rows if r.get("runtime_api")]
    if runtime:
        out += ["", "| case | CUDA runtime calls a step: calls x, host µs (longest first) |", "|---|---|"]
        for r in runtime:
            calls = ", ".join(f"{name} {c['calls']:.0f}x {c['host_us']:.0f}" for name, c in r["runtime_api"].items())
            out.append(f"| {_case(r)} | {calls} |")
    return out


def regions_table(path: str) -> list[str]:
    """``tools/kernel_rates.py``'s ``region`` rows: each merge and sum on the ring step's operands, per variant,
    its GPU time a call with the host ahead, the bandwidth that is, and the host's time a call."""
    out = ["| region call | variant | GPU µs a call | GB/s | host µs a call |", "|---|---|---|---|---|"]
    for r in _lines(path):
        if r.get("part") == "region" and "gpu_us" in r:
            out.append(f"| {r['case']} | {r['variant']} | {_held(r['gpu_us'], r['host_ahead'])} | "
                       f"{r['gb_per_s']:.0f} | {r['host_us']:.1f} |")
    return out


def varlen_table(path: str) -> list[str]:
    """``tools/kernel_rates.py``'s ``varlen`` rows: a packed step's pieces one call each (as shipped, and with
    flash) against one variable-length flash call per mask kind: fwd+bwd cold, with the host ahead, the host's
    issue time and the largest difference of the outputs from the shipped calls'."""
    rows = [r for r in _lines(path) if r.get("part") == "varlen"]
    if not rows:
        return []
    out = ["| step (tasks) | way | calls | cold ms | host ahead ms | host issue ms | max diff from shipped |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['step']} ({r['tasks']}) | {r['way']} | {r['calls']} | {r['cold_ms']:.2f} | "
                   f"{_held(r['host_ahead_ms'], r['host_ahead'])} | {r['host_issue_ms']:.2f} | "
                   f"{r['max_diff_from_per_task']:.1e} |")
    return out


def window_table(path: str) -> list[str]:
    """``tools/kernel_rates.py``'s ``window`` rows: a rank's own sliding window as shipped (anticausal runs on rows
    flipped) against one flash call with the window native: fwd+bwd cold, with the host ahead, the host's issue
    time and the largest difference of out, dq, dk and dv from the shipped step's."""
    rows = [r for r in _lines(path) if r.get("part") == "window"]
    if not rows:
        return []
    out = ["| window | way | cold ms | host ahead ms | host issue ms | max diff out / dq / dk / dv |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        diff = " / ".join(f"{r['max_diff_from_shipped'][name]:.1e}" for name in ("out", "dq", "dk", "dv"))
        out.append(f"| {r['window']} | {r['way']} | {r['cold_ms']:.2f} | {_held(r['host_ahead_ms'], r['host_ahead'])} "
                   f"| {r['host_issue_ms']:.2f} | {diff} |")
    return out


def occupancy_table(path: str, profile: str) -> list[str]:
    """The short picks' calls at 4 to 32 heads (``tools/kernel_rates.py``'s ``occupancy`` rows): the busy share
    measured beside the planner's model (``tools/calibrate_profile.occupancy_rows`` with ``profile``)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from mcp_context.plan import load_profile
    from tools.calibrate_profile import occupancy_rows

    rows = occupancy_rows(load_profile(profile), list(_lines(path)))
    if not rows:
        return []
    out = ["| block | heads | fwd measured | fwd model | bwd measured | bwd model |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['mask']} {r['rows']}x{r['keys']} | {r['heads']} | {r['measured_fwd']:.2f} | "
                   f"{r['model_fwd']:.2f} | {r['measured_bwd']:.2f} | {r['model_bwd']:.2f} |")
    return out


def _verdict(value, target: float, above: bool = True) -> str:
    if value is None:
        return "not measured"
    met = value >= target if above else value <= target
    return f"{value:.3f}: {'met' if met else 'not met'} ({'>=' if above else '<='} {target})"


def report(results: str) -> str:
    lines = [f"# GPU checks: {os.path.abspath(results)}", ""]
    summary = os.path.join(results, "summary.jsonl")
    if os.path.exists(summary):
        lines += ["## Steps", ""] + steps_table(summary) + [""]
    benches = sorted(glob.glob(os.path.join(results, "bench", "bench_attention_*.jsonl")))
    seen: dict = {}
    if benches:
        table, seen = bench_table(benches)
        lines += ["## One rank's step against one fused call of equal useful FLOPs", "",
                  "fwd+bwd and fwd: ours over the fused call, each step timed alone (the GPU idle until the host "
                  "issues its first kernel); host ahead: fwd+bwd with the GPU held busy while the host issues the "
                  "step, as in training, where the layers before it keep the queue full ('*': the host still fell "
                  "behind); graphed: fwd+bwd replayed from CUDA graphs (step_graphs; '†': a ring, captured here only "
                  "because one GPU's walk moves nothing: the engine refuses graphs for it); "
                  "host issue: the host's time to issue one fwd+bwd; syncs: host-device synchronisations "
                  "in one step; vs fused at S/P: ring-flash-attention's baseline; "
                  "side stream gain: the in-order step's time over the overlapped one; peak memory: ours over the "
                  "fused call's (in order: without the side stream).", ""] + table + [""]
    picks_path = os.path.join(results, "picks.jsonl")
    measured: list[float] = []
    ahead: list[float] = []
    graphed: list[float] = []
    if os.path.exists(picks_path):
        table, measured, ahead, graphed = picks_table(picks_path)
        lines += ["## The planner's picks", ""] + table + [""]
    profile_path = os.path.join(results, "profile.jsonl")
    if os.path.exists(profile_path):
        table = occupancy_table(profile_path, "h200_nvlink_ib")
        if table:
            lines += ["## Calls too small to fill the GPU (tools/kernel_rates.py --parts occupancy)", "",
                      "The share of the GPU each call keeps busy, measured as its FLOP rate per head over the same "
                      "block's at 32 heads (GPU time with the host ahead), beside the planner's occupancy model "
                      "(plan/cost.occupancy, the h200_nvlink_ib profile: 132 SMs, 128-row tiles).", ""] + table + [""]
        table = varlen_table(profile_path)
        if table:
            lines += ["## A packed step's pieces in one variable-length call (tools/kernel_rates.py --parts varlen)",
                      "", "Rank 0's first two ring steps of a packed 32K sequence over 8 ranks (50 documents, balanced "
                      "layout): one call per document piece as shipped, one flash call per piece, and one "
                      "variable-length flash call per mask kind (rows gathered); '*': the host fell behind the "
                      "hold.", ""] + table + [""]
        table = window_table(profile_path)
        if table:
            lines += ["## A window's lower edge without flips (tools/kernel_rates.py --parts window)", "",
                      "A rank's own sliding window (16384 query rows, each seeing the window's keys before it) as "
                      "shipped, its anticausal runs on rows flipped, and as one flash call with the window native; "
                      "'*': the host fell behind the hold.", ""] + table + [""]
    host_path = os.path.join(results, "host_costs.jsonl")
    if os.path.exists(host_path):
        lines += ["## Where the host's time goes (tools/host_costs.py)", "",
                  "Each fused region run eagerly in turn, every compiled call through dynamo ('through_dynamo', where "
                  "the shipped step calls a layout seen before directly), and the side stream off ('in_order'), "
                  "against the step as shipped; '*': the host fell behind the hold.", ""] + host_costs_table(host_path) + [""]
    regions_path = os.path.join(results, "regions.jsonl")
    if os.path.exists(regions_path):
        lines += ["## The merges' and sums' kernels (tools/kernel_rates.py --parts regions)", "",
                  "Each region on the operands of the ring step at 32K/P8, a run of calls timed together: as "
                  "shipped (automatic dynamic shapes: only the rows symbolic; called directly), through dynamo, compiled "
                  "per shape, with every size symbolic, eager; GB/s of the bytes each call must move; '*': the "
                  "host fell behind the hold.", ""] + regions_table(regions_path) + [""]
    p2p = {s: seen.get(("p2p", s, 8), {}) for s in (32768, 131072)}
    peaks: dict[str, list[float]] = {}  # by scheme
    for (comm, _, _), fb in seen.items():
        if fb.get("memory_ratio"):
            peaks.setdefault(comm, []).append(fb["memory_ratio"])
    p2p_peaks = peaks.pop("p2p", [])
    others = {comm: max(m) for comm, m in sorted(peaks.items(), key=lambda x: max(x[1]))}
    lines += ["## Against the targets", "",
              f"- p2p fwd+bwd at 32K/P8: {_verdict(p2p[32768].get('efficiency'), TARGETS['p2p_32k_p8'])}; "
              f"host ahead {_verdict(p2p[32768].get('queued_efficiency'), TARGETS['p2p_32k_p8'])}; "
              f"graphed (one GPU, transfers not captured) "
              f"{_verdict(p2p[32768].get('graphed_efficiency'), TARGETS['p2p_32k_p8'])}",
              f"- p2p fwd+bwd at 128K/P8: {_verdict(p2p[131072].get('efficiency'), TARGETS['p2p_128k_p8'])}; "
              f"host ahead {_verdict(p2p[131072].get('queued_efficiency'), TARGETS['p2p_128k_p8'])}",
              f"- the planner's pick, lowest of {len(measured)} cells measured: "
              f"{_verdict(min(measured) if measured else None, TARGETS['pick'])}; host ahead, lowest of "
              f"{len(ahead)}: {_verdict(min(ahead) if ahead else None, TARGETS['pick'])}; replayed from CUDA graphs "
              f"(step_graphs, the {len(graphed)} picks whose K/V are local to the step), lowest: "
              f"{_verdict(min(graphed) if graphed else None, TARGETS['pick'])}",
              f"- p2p's peak memory (the target's 1.03x was p2p's), highest of {len(p2p_peaks)} steps: "
              f"{_verdict(max(p2p_peaks) if p2p_peaks else None, TARGETS['memory'], above=False)}; the other "
              f"schemes' highest: " + (", ".join(f"{c} {m:.2f}x" for c, m in others.items()) or "not measured")
              + " (the gathered kinds hold the whole sequence's K/V and its dK/dV sums: more than one call of "
              "equal FLOPs holds, by design)", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="?", default="runs/gpu_checks", help="tools/gpu_checks.sh's results folder")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.results):
        ap.error(f"results folder {args.results!r} does not exist; run make test-gpu first (or name its folder)")
    print(report(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
