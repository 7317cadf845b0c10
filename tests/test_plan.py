"""The planner's figures come from the engine: bytes equal a real gloo run's, balance the schedule's.

- Bytes: for every scheme at P=4 the dry run (meta tensors, fake process group) counts, rank by rank,
  exactly (==) the bytes the comm layer counts in a real forward+backward on gloo.
- Balance: equals both the schedule's ``load_balance`` and a brute-force count of visible pairs per
  ring member from the layout's positions (rel 1e-12).
- MLA (value head dim unlike q/k's): bytes equal a real run's and the analytic K+V ring figures.
- Intra/inter-node split, the cost model's overlap arithmetic, memory scaling with S/P, the
  recommendation and the CLI are checked on small cases with hand-computed figures.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mcp_context.layouts import layout_spans, spans_positions
from mcp_context.masks import CAUSAL, BlockMask
from mcp_context.plan import Candidate, PlanRequest, RankShape, dry_run_rank, evaluate, load_profile, plan
from mcp_context.plan.planner import explain
from mcp_context.plan.report import plan_table
from mcp_context.plan.__main__ import main
from mcp_context.plan.cost import Accumulation, Fabric, call_seconds, layer_bytes, predict, step_compute
from mcp_context.plan.model import parameters, planning_shape
from mcp_context.plan.profiles import PROFILE_DIR, MachineProfile
from mcp_context.recipes.schema import ModelConfig
from mcp_context.schedule import layout_schedule, load_balance
from tests._dist import run_distributed

REPO = Path(__file__).resolve().parents[1]
DOCS_GPU = REPO / "docs" / "gpu"
SEQ, B, H, D = 64, 2, 8, 4
SCHEMES = [("p2p", (4,)), ("a2a", (4,)), ("all_gather", (4,)), ("a2a+p2p", (2, 2))]


def _real_bytes(rank, world, comm, sizes, layout, kv_heads, dqk=D, dv=D):
    from mcp_context import build_hcp_groups, comm_stats, context_parallel_attention

    groups = build_hcp_groups(list(sizes))
    q, k, v = (torch.randn(SEQ // world, B, h, d, requires_grad=True)
               for h, d in ((H, dqk), (kv_heads, dqk), (kv_heads, dv)))
    comm_stats.reset()
    out = context_parallel_attention(q, k, v, groups, causal=True, layout=layout, comm=comm)
    forward = dict(comm_stats.bytes_sent)
    out.backward(torch.randn_like(out))
    return forward, {op: n - forward.get(op, 0) for op, n in comm_stats.bytes_sent.items() if n - forward.get(op, 0)}


@pytest.mark.parametrize("comm,sizes", SCHEMES)
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_dry_run_bytes_equal_the_comm_layers_counted_bytes(comm, sizes, kv_heads):
    layout = "zigzag" if kv_heads == 8 else "striped"
    real = run_distributed(4, _real_bytes, comm, sizes, layout, kv_heads)
    shape = RankShape(SEQ, B, H, kv_heads, D, torch.float32)
    for rank, (forward, backward) in enumerate(real):
        dry = dry_run_rank(comm, sizes, layout, CAUSAL, shape, rank)
        assert (dry.forward, dry.backward) == (forward, backward), f"rank {rank}"


@pytest.mark.parametrize("comm,sizes", [("p2p", (4,)), ("a2a+p2p", (2, 2))])
def test_mla_dry_run_bytes_equal_the_comm_layers_and_the_analytic_k_plus_v(comm, sizes):
    """MLA (q/k head dim 24, value head dim 16; one K/V head per query head): K and V travel with their
    own sizes. The dry run's bytes equal a real gloo run's, rank by rank, and the analytic ring figures:
    forward, each member passes its K+V block on (ring size - 1) times, s_local * B * heads_held *
    (dqk + dv) elements (p2p: all 8 heads of its own shard; [2, 2]: half the heads of the pair's two
    shards, the same count); backward, K+V again and dK+dV in fp32 ring size times (home included)."""
    dqk, dv = 24, 16
    real = run_distributed(4, _real_bytes, comm, sizes, "zigzag", H, dqk, dv)
    shape = RankShape(SEQ, B, H, H, dqk, torch.float32, dv)
    for rank, (forward, backward) in enumerate(real):
        dry = dry_run_rank(comm, sizes, "zigzag", CAUSAL, shape, rank)
        assert (dry.forward, dry.backward) == (forward, backward), f"rank {rank}"
    ring = sizes[-1]
    kv_block = SEQ // 4 * B * H * (dqk + dv) * 4  # fp32; [2, 2]: 2 shards x H/2 heads, the same
    assert dry.forward["ring_kv"] == (ring - 1) * kv_block != (ring - 1) * SEQ // 4 * B * H * 2 * dqk * 4
    assert (dry.backward["ring_kv"], dry.backward["ring_dkv"]) == ((ring - 1) * kv_block, ring * kv_block)
    if comm == "a2a+p2p":  # q, k, v scattered over the pair, out gathered back: half of each crosses
        assert dry.forward["all_to_all"] == SEQ // 4 * B * H * (dqk + dqk + dv + dv) * 4 // 2


def test_the_planner_reads_mla_head_dims_from_the_recipe(h100):
    """An MLA recipe plans with q/k head dim qk_head_dim + qk_pos_emb_head_dim, value head dim
    v_head_dim and one K/V head per query head; the parameter count is MLA's projections'."""
    from mcp_context.plan.planner import rank_shape
    from mcp_context.recipes import load_recipe

    m = load_recipe(REPO / "recipes" / "tiny_mla_cpu.yaml").model
    req = PlanRequest(m, m.seq_length, 4, h100, micro_batch_size=B, dtype=torch.float32)
    shape = rank_shape(req)
    assert (shape.head_dim, shape.dv, shape.heads, shape.kv_heads) == (24, 16, 4, 4)
    row = evaluate(req, Candidate(4, (4,), "p2p", "zigzag"))
    assert row.forward_bytes == {"ring_kv": 3 * m.seq_length // 4 * B * 4 * (24 + 16) * 4}
    h, r_q, r_kv, heads = m.hidden_size, m.q_lora_rank, m.kv_lora_rank, m.num_attention_heads
    attention = h * r_q + r_q * heads * 24 + h * (r_kv + 8) + r_kv * heads * (16 + 16) + heads * 16 * h
    moe = 4 * 3 * h * 64 + 3 * h * 64 + h * 4  # 4 experts, the shared expert, the router
    assert parameters(req.model) == 2 * (attention + 2 * h + moe) + 2 * req.model.vocab_size * h + h
    assert "head dim q/k 24, v 16" in plan_table(plan(dataclasses.replace(req, cp_sizes=(4,))))


def _brute_force_balance(layout, cp, seq, inner):
    """Visible (causal) pairs per ring member from positions alone: query position i sees i+1 keys."""
    pairs = []
    for g in range(0, cp, inner):
        pos = torch.cat([spans_positions(layout_spans(layout, cp, r, seq)) for r in range(g, g + inner)])
        pairs.append(int((pos + 1).sum()))
    return max(pairs) * len(pairs) / sum(pairs)


def _request(profile, seq=SEQ, gpus=4, tp=1, pp=1, model=None):
    model = model or ModelConfig(num_layers=2, hidden_size=H * D, num_attention_heads=H, num_query_groups=2,
                                 kv_channels=D, ffn_hidden_size=64, vocab_size=256)
    return PlanRequest(model, seq, gpus, profile, tp, pp, B, True, torch.float32)


@pytest.fixture(scope="module")
def h100():
    return load_profile("h100_nvlink_ib")


def test_plan_balance_equals_the_schedule_and_a_brute_force_count(h100):
    result = plan(_request(h100, seq=96, gpus=4), dry_run_all=True)
    assert {r.candidate.layout for r in result.rows} == {"contiguous", "zigzag", "striped"}
    for row in result.rows:
        c = row.candidate
        sched = layout_schedule(c.layout, c.cp_size, 96, CAUSAL, c.a2a_degree)
        assert row.load_balance == load_balance(sched)
        assert row.load_balance == pytest.approx(_brute_force_balance(c.layout, c.cp_size, 96, c.a2a_degree),
                                                 rel=1e-12)


def test_bytes_split_by_node_boundary(h100):
    """TP1, 2 GPUs a node, p2p ring 0->1->2->3->0: ranks 0 and 2 send inside their node, 1 and 3 across."""
    profile = MachineProfile(**{**h100.__dict__, "gpus_per_node": 2})
    shape = RankShape(SEQ, B, H, 2, D, torch.float32)
    fabric = Fabric(profile, tp=1)
    for rank in range(4):
        tr = dry_run_rank("p2p", (4,), "zigzag", CAUSAL, shape, rank)
        total = sum(tr.forward.values()) + sum(tr.backward.values())
        both = {op: tr.forward.get(op, 0) + tr.backward.get(op, 0) for op in tr.backward}
        assert fabric.split(tr, both) == ((total, 0) if rank % 2 == 0 else (0, total)), rank
    # a2a over 4 ranks on 2-GPU nodes: one of the three peers is on the same node
    tr = dry_run_rank("a2a", (4,), "zigzag", CAUSAL, shape, 0)
    intra, inter = fabric.split(tr, tr.forward)
    assert intra * 2 == inter and intra + inter == tr.forward["all_to_all"]


@pytest.mark.parametrize("comm,sizes", [("p2p", (20,)), ("a2a+p2p", (4, 5))])
def test_sampled_ranks_give_the_same_figures_as_all_ranks(h100, comm, sizes):
    """Beyond 16 CP ranks the planner dry-runs the first and last node only (here 4 GPUs a node): the same bytes
    on the wire, and the same prediction within 1e-4 (a middle rank of a ring merges its blocks at other steps
    than the first and last nodes' ranks, so its work around the calls differs by a few bytes a step)."""
    profile = MachineProfile(**{**h100.__dict__, "gpus_per_node": 4})
    req = _request(profile, seq=80, gpus=20)
    cand = Candidate(20, sizes, comm, "zigzag")
    sampled, full = evaluate(req, cand), evaluate(req, cand, ranks=list(range(20)))
    assert sampled.dry_run_ranks == [0, 1, 2, 3, 16, 17, 18, 19]
    assert (sampled.intra_node_bytes, sampled.inter_node_bytes) == (full.intra_node_bytes, full.inter_node_bytes)
    assert sampled.inter_node_bytes > 0
    for name, value in vars(full.prediction).items():
        assert getattr(sampled.prediction, name) == pytest.approx(value, rel=1e-4), name


def test_cost_model_overlap_arithmetic(h100):
    """P=2 p2p zigzag: forward = max(step-0 compute, transfer) + step-1 compute; no overlap = their sum."""
    shape = RankShape(SEQ, B, H, 2, D, torch.float32)
    traffics = [dry_run_rank("p2p", (2,), "zigzag", CAUSAL, shape, r) for r in range(2)]
    fabric = Fabric(h100, tp=8)  # TP8: the two CP ranks are on different nodes
    pred = predict(shape, 1, traffics, fabric)
    c_fwd, c_bwd = step_compute(traffics, shape, 1, h100)
    c0, c1 = c_fwd
    transfer = (traffics[0].forward["ring_kv"] / (h100.inter_node_bandwidth_gbps * 1e9)
                + h100.inter_node_latency_us * 1e-6)
    assert pred.forward_s == pytest.approx(max(c0, transfer) + c1, rel=1e-12)
    assert pred.forward_no_overlap_s == pytest.approx(c0 + transfer + c1, rel=1e-12)
    assert pred.total_s < pred.total_no_overlap_s
    extra = max(layer_bytes(shape, H, 2, tr.tasks, tr.q_rows, tr.kv_rows, Accumulation.of(tr.tasks, tr.kv_rows),
                            ring=True)
                for tr in traffics) / (h100.memory_bandwidth_gbps * 1e9)
    assert pred.compute_s == pytest.approx(sum(c_fwd) + sum(c_bwd) + extra, rel=1e-12)


def test_a_call_costs_its_flops_at_the_tables_rate_plus_the_overhead(h100):
    """A causal square at a table's length runs at that row's rates; between rows the rate is log-linear;
    every call pays the fitted overhead once forward and once backward."""
    from mcp_context.masks import CAUSAL_BLOCK
    from mcp_context.schedule import BlockTask

    rows, fwd_rate, both_rate = h100.causal_tflops[2]
    task = BlockTask((0, int(rows)), (0, int(rows)), CAUSAL_BLOCK)
    flops = task.useful_pairs * 4 * D
    fwd, bwd = call_seconds(h100, task, 4 * D, 32)  # the tables' 32 heads: the call fills the GPU
    overhead = h100.call_overhead_us * 1e-6
    assert fwd == pytest.approx(flops / (fwd_rate * 1e12) + overhead, rel=2e-4)  # sqrt(2 pairs) ~ rows
    assert fwd + bwd == pytest.approx(3.5 * flops / (both_rate * 1e12) + 2 * overhead, rel=2e-4)
    short, long_ = (call_seconds(h100, BlockTask((0, n), (0, n), CAUSAL_BLOCK), 4 * D, 32)[0] / (n * n)
                    for n in (2048, 8192))
    assert short > 1.5 * long_  # a short block runs at a lower rate (H100: 206 against 511 TFLOP/s fwd+bwd)


def test_the_calibrated_h200_profile_predicts_every_measured_rank_step_within_15_percent():
    """The shipped H200 profile is what tools/calibrate_profile.py fits to the shipped H200 measurements, and
    with it the model predicts every measured rank step (five schemes, 32K and 128K, P = 8 and 16; 32K/P8
    and 128K/P8 are the issue's bar) within 15 %."""
    from tools.calibrate_profile import _lines, calibrate

    shipped = load_profile("h200_nvlink_ib")
    with open(DOCS_GPU / "h200_run1_bench.json") as f:
        bench = json.load(f)
    fitted, rows = calibrate(shipped, _lines(DOCS_GPU / "h200_run1_rates.jsonl"), bench)
    assert (fitted.memory_bandwidth_gbps, fitted.call_overhead_us) == pytest.approx(
        (shipped.memory_bandwidth_gbps, shipped.call_overhead_us), rel=0.01)
    assert {(r["seq_len"], r["cp"]) for r in rows} >= {(32768, 8), (131072, 8)}
    worst = max(rows, key=lambda r: abs(r["error"]))
    assert abs(worst["error"]) <= 0.15, worst


@pytest.mark.parametrize("comm,sizes", SCHEMES)
def test_attention_memory_scales_as_s_over_p(comm, sizes):
    """Same S and heads, the attention layer's saved and peak bytes halve when each rank holds half."""
    small, large = (dry_run_rank(comm, sizes, "zigzag", CAUSAL, RankShape(seq, B, H, 8, D, torch.float32), 0)
                    for seq in (64, 128))
    assert large.saved_bytes == 2 * small.saved_bytes and large.peak_bytes == 2 * small.peak_bytes
    # what stays saved at least holds q, k, v and out of the local shard
    assert small.saved_bytes >= 4 * (64 // 4) * B * H * D * 4


def test_recommends_no_cp_when_it_fits_and_says_why(h100):
    result = plan(_request(h100, seq=64, gpus=4))
    assert result.recommended.candidate.cp_size == 1 and result.recommended.fits
    assert any("fastest" in r for r in result.reasons)


def test_llama3_70b_memory_falls_with_cp_and_fits_only_on_the_larger_gpu(h100):
    """Llama-3-70B (70.6e9 parameters), 1M tokens, 64 GPUs, TP8 PP1: CP8 needs less than CP2; on
    80 GiB neither fits (model state alone is ~62 GiB), on 141 GiB CP8 does."""
    model = ModelConfig(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8, kv_channels=128,
                        ffn_hidden_size=28672, vocab_size=None)
    assert parameters(planning_shape(model)) == pytest.approx(70.6e9, rel=0.01)
    h100_rows = {c: evaluate(PlanRequest(model, 2 ** 20, 64, h100, tp=8), Candidate(c, (c,), "p2p", "zigzag"))
                 for c in (2, 8)}
    assert h100_rows[8].memory_bytes < h100_rows[2].memory_bytes
    assert not h100_rows[8].fits and not h100_rows[2].fits
    h200 = evaluate(PlanRequest(model, 2 ** 20, 64, load_profile("h200_nvlink_ib"), tp=8),
                    Candidate(8, (8,), "p2p", "zigzag"))
    assert h200.fits and h200.memory_bytes == h100_rows[8].memory_bytes


def test_cli_table_json_and_errors(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["--layers", "2", "--hidden", "32", "--heads", "8", "--kv-heads", "2", "--seq-len", "64", "--gpus", "4",
            "--vocab", "256"]
    assert main(args + ["--json", str(out)]) == 0
    table = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert "recommended:" in table and data["recommended"]["layout"] in table
    assert len(data["candidates"]) == len(table.strip().split("\n\nrecommended")[0].splitlines()) - 2
    assert main(["--gpus", "4", "--seq-len", "64"]) == 2
    assert "--layers, --hidden, --heads" in capsys.readouterr().err
    assert main(args + ["--profile", "nope"]) == 2
    assert "h100_nvlink_ib" in capsys.readouterr().err
    assert main(args[:-4] + ["--gpus", "5", "--tp", "2"]) == 2
    assert "gpus=5" in capsys.readouterr().err
    assert main(args + ["--pp", "3"]) == 2
    assert "num_layers=2 is not divisible by pipeline_model_parallel_size=3" in capsys.readouterr().err


def test_profiles_load_and_reject_bad_fields(tmp_path):
    for name in ("h100_nvlink_ib", "h200_nvlink_ib"):
        p = load_profile(name)
        assert p.gpus_per_node == 8 and p.inter_node_bandwidth_gbps < p.intra_node_bandwidth_gbps
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngpus_per_node: 8\n")
    with pytest.raises(ValueError, match="missing fields"):
        load_profile(str(bad))
    text = (PROFILE_DIR / "h100_nvlink_ib.yaml").read_text()
    bad.write_text(text.replace("memory_gib: 80.0", "memory_gib: -1"))
    with pytest.raises(ValueError, match="memory_gib=-1 must be a positive number"):
        load_profile(str(bad))
    bad.write_text(text.replace("sm_count: 132", "sm_count: 131.5"))
    with pytest.raises(ValueError, match="sm_count=131.5 must be an integer"):
        load_profile(str(bad))
    bad.write_text(text.replace("attention_tile_rows: 128", "attention_tile_rows: 0"))
    with pytest.raises(ValueError, match="attention_tile_rows=0 must be a positive number"):
        load_profile(str(bad))


def test_storage_bytes_equal_memtrackers_figures():
    """The dry run's light tracker reports MemTracker's current and peak device totals, every scheme and rank."""
    from torch.distributed._tools.mem_tracker import MemTracker

    import mcp_context.plan.dryrun as dryrun

    class MemTrackerTotals(MemTracker):
        @property
        def current(self):
            return sum(s.get("Total", 0) for s in self.get_tracker_snapshot("current").values())

        @property
        def peak(self):
            return sum(s.get("Total", 0) for s in self.get_tracker_snapshot("peak").values())

    shape = RankShape(SEQ, B, H, 2, D, torch.bfloat16)
    for comm, sizes in SCHEMES:
        for rank in range(4):
            light = dry_run_rank(comm, sizes, "zigzag", CAUSAL, shape, rank)
            dryrun.StorageBytes, light_tracker = MemTrackerTotals, dryrun.StorageBytes
            try:
                reference = dry_run_rank(comm, sizes, "zigzag", CAUSAL, shape, rank)
            finally:
                dryrun.StorageBytes = light_tracker
            assert (light.saved_bytes, light.peak_bytes) == (reference.saved_bytes, reference.peak_bytes), (comm, rank)
            assert light.peak_bytes > light.saved_bytes > 0


ARGS = ["--layers", "2", "--hidden", "32", "--heads", "8", "--kv-heads", "2", "--seq-len", "64", "--gpus", "4",
        "--vocab", "256", "--no-progress"]


@pytest.mark.parametrize("flag", ["--layers", "--hidden", "--heads", "--kv-heads", "--head-dim", "--ffn-hidden",
                                  "--vocab", "--seq-len", "--gpus", "--gpus-per-node", "--tp", "--pp",
                                  "--micro-batch-size", "--cp-sizes", "--jobs"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_cli_refuses_out_of_range_values_in_one_line(flag, value, capsys):
    """--gpus-per-node 0 used to divide by zero: every integer flag is checked, the error names flag, value, range."""
    with pytest.raises(SystemExit) as exit_:
        main(ARGS + [flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert f"argument {flag}: '{value}' is not an integer >= 1" in err


def test_cli_refuses_bad_combinations_before_planning(tmp_path, capsys):
    recipe = "recipes/tiny_cpu.yaml"
    assert main(["--recipe", recipe, "--layers", "3", "--gpus", "4"]) == 2
    assert f"--layers cannot be combined with --recipe={recipe}" in capsys.readouterr().err
    assert main(["--recipe", str(tmp_path / "none.yaml"), "--gpus", "4"]) == 2
    assert "none.yaml: no such file" in capsys.readouterr().err
    assert main(ARGS + ["--json", str(tmp_path / "missing" / "plan.json")]) == 2
    assert "does not exist; create it first" in capsys.readouterr().err
    assert main(ARGS + ["--cp-sizes", "3"]) == 2
    assert "[3] do not divide gpus / (tp * pp) = 4; choose from [1, 2, 4]" in capsys.readouterr().err


def test_cp_sizes_restrict_the_candidates_and_progress_counts_them(h100, capsys):
    full = plan(_request(h100, seq=64, gpus=4), dry_run_all=True)
    only = plan(dataclasses.replace(_request(h100, seq=64, gpus=4), cp_sizes=(2,)), progress=True, dry_run_all=True)
    assert {r.candidate.cp_size for r in only.rows} == {2}
    assert {r.candidate for r in only.rows} == {
        r.candidate for r in full.rows if r.candidate.cp_size == 2}
    bar = capsys.readouterr().err
    assert f"{len(only.rows)}/{len(only.rows)}" in bar and "dry runs" in bar


def test_worker_processes_give_the_same_plan(h100):
    """--jobs 2: the candidates' dry runs in two spawned processes give the same rows, reasons and candidates not
    dry-run (a window over 4 ranks: the striped layouts' host time alone rules them out)."""
    req = dataclasses.replace(_request(h100, seq=128, gpus=4), cp_sizes=(2, 4), window_size=(3, 0))
    here, workers = plan(req), plan(req, jobs=2)
    assert [r.__dict__ for r in workers.rows] == [r.__dict__ for r in here.rows] and len(here.rows) > 2
    assert workers.reasons == here.reasons and workers.skipped == here.skipped and here.skipped


def test_jobs_auto_spawns_workers_only_for_plans_of_16_ranks_or_more(h100, capsys):
    """``--jobs auto`` (the default): the usable CPUs, at most 8, where a CP size of 16 or more is planned (on
    an idle 2-core machine a CP-16 plan took 55-70 s in one process and 34-42 s in two), else 1 (a CP-8 plan: 8.6 s
    in one, 9.4 s in two: each worker imports torch); the CLI reads ``auto`` as None and a bad value names it."""
    from mcp_context.plan.__main__ import _parser
    from mcp_context.plan.planner import auto_jobs, usable_cpus

    cases = [((8,), 2), ((2, 16), 2), ((64,), 32), ((64,), 1)]
    assert [auto_jobs(sizes, cpus) for sizes, cpus in cases] == [1, 2, 8, 1]
    assert usable_cpus() >= 1
    assert _parser().parse_args(ARGS).jobs is None and _parser().parse_args(ARGS + ["--jobs", "auto"]).jobs is None
    assert _parser().parse_args(ARGS + ["--jobs", "3"]).jobs == 3
    with pytest.raises(SystemExit):
        main(ARGS + ["--jobs", "many"])
    assert "argument --jobs: 'many' is not an integer >= 1 (or auto)" in capsys.readouterr().err
    req = dataclasses.replace(_request(h100, seq=64, gpus=4), cp_sizes=(2,))
    assert [r.__dict__ for r in plan(req, jobs=None).rows] == [r.__dict__ for r in plan(req).rows]


def test_planner_reads_the_shape_that_recipes_and_the_converter_give(h100):
    """One model shape: a recipe's model section and a converted Hugging Face config.json plan as
    given, and the same model described both ways gets the same numbers and the same plan."""
    from mcp_context.convert.model_config import hf_model_from_config
    from mcp_context.plan.model import PLANNED_FIELDS
    from mcp_context.recipes import load_recipe

    recipe = load_recipe("recipes/llama3_8b_128k_hcp.yaml").model
    llama3_8b = hf_model_from_config({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
        "max_position_embeddings": 131072}).shape
    from_recipe = PlanRequest(recipe, 2 ** 17, 64, h100, tp=4, pp=2)
    from_hf = PlanRequest(llama3_8b, 2 ** 17, 64, h100, tp=4, pp=2)
    assert from_hf.model == llama3_8b  # every size given: nothing filled in
    assert {f: getattr(from_recipe.model, f) for f in PLANNED_FIELDS} == \
        {f: getattr(llama3_8b, f) for f in PLANNED_FIELDS}
    assert parameters(llama3_8b) == pytest.approx(8.03e9, rel=0.01)
    cand = Candidate(8, (2, 4), "a2a+p2p", "zigzag")
    a, b = evaluate(from_recipe, cand), evaluate(from_hf, cand)
    assert (a.model_state_bytes, a.activation_bytes, a.memory_bytes) == \
        (b.model_state_bytes, b.activation_bytes, b.memory_bytes)
    with pytest.raises(ValueError, match="num_attention_heads=32 is not a multiple of num_query_groups=5"):
        PlanRequest(dataclasses.replace(recipe, num_query_groups=5), 2 ** 17, 64, h100, tp=4, pp=2)


@pytest.mark.parametrize("layout,neighbours,steps", [("contiguous", 1, 2), ("zigzag", 2, 3)])
def test_a_quarter_shard_window_plans_the_halo_minimum_and_its_skipped_steps(h100, layout, neighbours, steps):
    """P = 8, causal window w = S/(4P), p2p: the planner's bytes per rank per layer are the analytic
    minimum of a halo (w rows of K and V to each neighbour that reads them, in the forward and again in
    the backward walk, and their dK/dV in fp32 back), and its table counts the steps with work (the
    busiest member: its own shard and the neighbours'); the plan says which ring steps are skipped."""
    seq, p = 8 * 64, 8
    w = seq // (4 * p)
    req = dataclasses.replace(_request(h100, seq=seq, gpus=p), cp_sizes=(p,), window_size=(w, 0))
    row = evaluate(req, Candidate(p, (p,), "p2p", layout))
    kv_row = B * 2 * D * 2 * 4  # one position's K and V: batch, 2 KV heads, head dim, fp32 (and dK/dV in fp32)
    assert row.forward_bytes == {"ring_kv": neighbours * w * kv_row}
    assert row.backward_bytes == {"ring_kv": neighbours * w * kv_row, "ring_dkv": neighbours * w * kv_row}
    assert (row.ring_steps, row.ring_steps_with_work) == (p, steps)
    full = evaluate(dataclasses.replace(req, window_size=(-1, -1)), Candidate(p, (p,), "p2p", layout))
    assert full.ring_steps_with_work == p and sum(full.forward_bytes.values()) > 3 * sum(row.forward_bytes.values())
    reasons = explain(req, row, [row, full])
    assert any(f"window_size=({w}, 0): {steps} of the ring's {p} steps have work; the other {p - steps} are skipped "
               f"(no compute, no transfer)" in r for r in reasons), reasons


def test_a_cp_size_with_one_layout_that_fits_is_not_reported_as_not_fitting(h100):
    """The recommendation's reasons list the smaller CP sizes of which no layout fits: CP 1 (its one layout
    too large), not CP 2, where one layout fits even though another does not."""
    req = _request(h100, seq=64, gpus=4)
    best = dataclasses.replace(evaluate(req, Candidate(4, (4,), "p2p", "zigzag")), fits=True)
    cp2 = evaluate(req, Candidate(2, (2,), "p2p", "zigzag"))
    rows = [best, dataclasses.replace(cp2, fits=True), dataclasses.replace(cp2, fits=False),
            dataclasses.replace(evaluate(req, Candidate(1, (1,), "none", "contiguous")), fits=False)]
    reasons = explain(req, best, rows)
    assert any(r.startswith("CP sizes [1] do not fit") for r in reasons), reasons


def test_a_pick_that_fits_nowhere_names_the_least_memory_where_it_is_not_that(h100):
    """When no layout fits, the pick is the fastest within ``TIE`` of the least memory: the reasons say it "needs
    the least" only when it does, and otherwise name the layout that does, with its figure."""
    from mcp_context.plan.planner import TIE

    req = _request(h100, seq=64, gpus=4)
    a = dataclasses.replace(evaluate(req, Candidate(4, (4,), "p2p", "zigzag")), fits=False)
    b = dataclasses.replace(evaluate(req, Candidate(4, (4,), "all_gather", "zigzag")), fits=False)
    smaller = dataclasses.replace(b, activation_bytes=int(a.memory_bytes / (1 + TIE / 2)) - b.model_state_bytes)
    (alone,) = [r for r in explain(req, a, [a]) if r.startswith("no layout fits")]
    assert "cp4 p2p zigzag needs the least (" in alone, alone
    (near,) = [r for r in explain(req, a, [a, smaller]) if r.startswith("no layout fits")]
    assert (f"cp4 p2p zigzag is the fastest within 2% of the least (cp4 all_gather zigzag, "
            f"{smaller.memory_bytes / 2**30:.1f} GiB) and needs ({a.memory_bytes / 2**30:.1f} GiB") in near, near


def test_the_plan_names_a_layout_that_needs_fewer_bytes(h100):
    """With a window of S/(4P) zigzag reads from two neighbours and contiguous from one: recommending
    zigzag, the plan says contiguous needs fewer bytes; recommending contiguous, it says nothing."""
    seq, p = 8 * 64, 8
    req = dataclasses.replace(_request(h100, seq=seq, gpus=p), cp_sizes=(p,), window_size=(seq // (4 * p), 0))
    zigzag, contiguous = (evaluate(req, Candidate(p, (p,), "p2p", layout)) for layout in ("zigzag", "contiguous"))
    line = [r for r in explain(req, zigzag, [zigzag, contiguous]) if "needs fewer bytes" in r]
    assert len(line) == 1 and line[0].startswith("cp8 p2p contiguous needs fewer bytes"), line
    assert not [r for r in explain(req, contiguous, [contiguous, zigzag]) if "needs fewer bytes" in r]


def test_a_bad_window_is_refused_before_planning(h100, capsys):
    with pytest.raises(ValueError, match=r"window_size=\(-3, 0\): left=-3 is negative"):
        dataclasses.replace(_request(h100), window_size=(-3, 0))
    with pytest.raises(SystemExit) as exit_:
        main(["--layers", "2", "--hidden", "32", "--heads", "8", "--seq-len", "64", "--gpus", "4", "--window-size", "8"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "argument --window-size: '8' is not LEFT,RIGHT" in err


@pytest.mark.parametrize("flag", ["--layers", "--hidden", "--heads", "--kv-heads", "--head-dim", "--ffn-hidden",
                                  "--vocab", "--seq-len", "--gpus", "--gpus-per-node", "--tp", "--pp",
                                  "--micro-batch-size", "--cp-sizes", "--jobs"])
def test_cli_refuses_values_above_each_flags_bound_in_one_line(flag, capsys):
    """``--seq-len 100000000000000000000`` used to die in a 30-line torch overflow inside the dry run:
    every integer flag has an upper bound, named with the flag and the value."""
    from mcp_context.plan.__main__ import MAX_VALUES

    big = "100000000000000000000"
    with pytest.raises(SystemExit) as exit_:
        main(ARGS + [flag, big])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert f"argument {flag}: '{big}' is above the largest value planned for, {MAX_VALUES[flag][0]} (" in err


def test_cli_refuses_a_shape_whose_dry_run_tensors_overflow_in_one_line(capsys):
    """Each flag within its bound, their product beyond what torch can size (int64 bytes)."""
    assert main(ARGS + ["--seq-len", str(2**26), "--micro-batch-size", str(2**20), "--heads", "65536",
                        "--kv-heads", "65536", "--hidden", "65536"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "above 2**62 bytes (torch sizes storage in int64); lower --seq-len" in err, err


MISTRAL_128K = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--ffn-hidden", "14336",
                "--vocab", "32000", "--seq-len", "131072", "--gpus", "8", "--tp", "1", "--cp-sizes", "8"]


DOCUMENTED_ROWS = [("p2p", (8,), "zigzag"), ("p2p", (8,), "contiguous"), ("a2a", (8,), "zigzag"),
                   ("a2a+p2p", (2, 4), "zigzag"), ("a2a+all_gather", (2, 4), "contiguous"),
                   ("all_gather", (8,), "zigzag")]


FLOAT_REL = 1e-9
"""Relative tolerance of a documented plan's floats: far above the rounding of a reordered sum (1e-16
per term), far below any change of the model (the figures are printed to 3 digits)."""


def _assert_same_row(got, shipped, where: str) -> None:
    """``got == shipped`` field for field, floats within ``FLOAT_REL`` relative, everything else exact."""
    if isinstance(shipped, dict):
        assert isinstance(got, dict) and got.keys() == shipped.keys(), f"{where}: keys {got} != {shipped}"
        for key in shipped:
            _assert_same_row(got[key], shipped[key], f"{where}.{key}")
    elif isinstance(shipped, list):
        assert isinstance(got, list) and len(got) == len(shipped), f"{where}: {got} != {shipped}"
        for i, (a, b) in enumerate(zip(got, shipped)):
            _assert_same_row(a, b, f"{where}[{i}]")
    elif isinstance(shipped, float) and not isinstance(got, bool):
        assert got == pytest.approx(shipped, rel=FLOAT_REL, abs=0.0), f"{where}: {got!r} != {shipped!r}"
    else:
        assert type(got) is type(shipped) and got == shipped, f"{where}: {got!r} != {shipped!r}"


def test_a_documented_row_differs_in_an_exact_field_or_beyond_the_float_tolerance():
    row = {"ring_steps": 8, "predicted_seconds_per_layer": {"forward": 0.125}, "sizes": [2, 4]}
    _assert_same_row({"ring_steps": 8, "predicted_seconds_per_layer": {"forward": 0.125 * (1 + 1e-12)},
                      "sizes": [2, 4]}, row, "row")
    for changed in ({**row, "ring_steps": 9}, {**row, "predicted_seconds_per_layer": {"forward": 0.125 * (1 + 1e-8)}},
                    {**row, "sizes": [4, 2]}):
        with pytest.raises(AssertionError):
            _assert_same_row(changed, row, "row")


DOCUMENTED_PLANS = {"plan_mistral7b_128k_8gpu_window4096": "4095,0", "plan_mistral7b_128k_8gpu_causal": "-1,-1"}
PLAN_TORCH = "2.13"
"""The torch release that made ``docs/img``'s plan JSONs. The dry run's memory figures are what torch's
meta functions allocate, and they move between releases (torch 2.11 gave attention peaks 4-14 % lower
for these rows, 2026-11-26), so they are compared on this release only; every other field on any."""
TORCH_MEMORY = ("attention_peak", "activations", "total")


@pytest.fixture(scope="module")
def documented_rows():
    """``name -> [(label, row now, shipped row)]`` for each of ``DOCUMENTED_ROWS`` (not striped: its
    schedule costs ~10 s per row here), evaluated once per module (every scheme, every CP rank dry-run)."""
    from mcp_context.plan.__main__ import _parser, _request
    from mcp_context.plan.report import row_dict

    evaluated = {}

    def rows_of(name: str) -> list:
        if name not in evaluated:
            req = _request(_parser().parse_args(MISTRAL_128K + [f"--window-size={DOCUMENTED_PLANS[name]}"]))
            shipped = json.loads((REPO / "docs" / "img" / f"{name}.json").read_text())["candidates"]
            rows = {(r["cp_comm_type"], tuple(r["hierarchical_context_parallel_sizes"]), r["layout"]): r
                    for r in shipped}
            evaluated[name] = [(cand.label(), row_dict(evaluate(req, cand)), rows[comm, sizes, layout])
                               for comm, sizes, layout in DOCUMENTED_ROWS
                               for cand in [Candidate(8, sizes, comm, layout)]]
        return evaluated[name]

    return rows_of


def _without_torch_memory(row: dict) -> dict:
    return {**row, "memory_bytes_per_rank": {k: v for k, v in row["memory_bytes_per_rank"].items()
                                             if k not in TORCH_MEMORY}}


@pytest.mark.parametrize("name", DOCUMENTED_PLANS)
def test_the_documented_plans_rows_are_what_the_engine_gives_now(name, documented_rows):
    """``docs/img``'s plan JSONs are the planner's output for the commands in docs/performance.md:
    rows re-evaluated now equal the shipped ones field for field (bytes, balance, predicted times,
    saved memory; the peaks in the next test). An engine change that moves a figure (a view that
    outlives its step, a copy in a kernel) fails here until the JSON is regenerated on purpose.
    Counts, bytes and names compare exactly; floats (times, balance) to ``FLOAT_REL`` relative: the
    planner adds floats with ``sum()``, which rounds differently on Python 3.12+ (compensated
    summation) than on 3.11 (seen: 3.9e-16 relative)."""
    for label, now, shipped in documented_rows(name):
        _assert_same_row(_without_torch_memory(now), _without_torch_memory(shipped), label)


@pytest.mark.parametrize("name", DOCUMENTED_PLANS)
def test_the_documented_plans_memory_peaks_are_what_this_torch_allocates(name, documented_rows):
    if not torch.__version__.startswith(PLAN_TORCH + "."):
        pytest.skip(f"the plan JSONs' memory peaks were made with torch {PLAN_TORCH}; this is {torch.__version__}")
    for label, now, shipped in documented_rows(name):
        assert now["memory_bytes_per_rank"] == shipped["memory_bytes_per_rank"], label


def test_the_cost_model_holds_results_as_the_executor_does():
    """``Accumulation.of`` reads from the tasks what the executor does with them: a2a's one call is the result
    (no copy, no buffer), an all-gather's few calls hold out and dQ in bf16 (the one query run two calls
    meet is merged straight into the result) and sum dK/dV in bf16, handed on as views; a ring sums dK/dV in
    fp32. layer_bytes follows (bf16, Llama heads): nothing for a2a, nothing for the all-gather (its calls
    write every key row's dK/dV first, then add: no fill, no copy), and the old engine's fill and result
    copies when every row goes ``through`` fp32."""
    import sys

    sys.path.insert(0, str(REPO))
    from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel
    from tools.rank_step import rank_step

    shape = RankShape(32768, 1, 32, 8, 128, torch.bfloat16)
    held = {}
    for comm in ("a2a", "all_gather", "p2p"):
        step = rank_step(comm, 8, 32768, CAUSAL, TorchKernel(FUSED_OPS["cudnn"]), 32, 8, 128)
        held[comm] = (Accumulation.of(step.plan.tasks, step.kv_rows), step)
    assert held["a2a"][0] == Accumulation(lone_kv=True, kv_exact=True)
    assert held["all_gather"][0] == Accumulation(lone_kv=False, kv_exact=True)
    assert held["p2p"][0] == Accumulation(lone_kv=False, kv_exact=False)
    assert held["all_gather"][1].plan.kv_sums_exact and not held["p2p"][1].plan.kv_sums_exact
    a2a, step = held["a2a"]
    assert layer_bytes(shape, step.heads, step.kv_heads, step.plan.tasks, step.q_rows, step.kv_rows, a2a) == 0
    gathered, step = held["all_gather"]
    kv = step.kv_rows * step.kv_heads * 256  # dK and dV of every key row, elements
    qo = step.q_rows * step.heads * 256      # out and dQ
    tasks = step.plan.tasks
    assert layer_bytes(shape, step.heads, step.kv_heads, tasks, step.q_rows, step.kv_rows, gathered) == 0
    old = Accumulation(lone_kv=False, through=True)
    assert layer_bytes(shape, step.heads, step.kv_heads, tasks, step.q_rows, step.kv_rows, old) == qo * 6 + kv * 10


def test_the_host_issue_time_counts_the_calls_with_work_and_bounds_the_layer(h100):
    """The host issues ``host_layer_us`` plus ``host_call_us`` per attention call of the busiest rank (a task with
    no visible pair is no call); a layer takes the longer of the GPU's time and the host's (``bound_s``), and
    the plan ranks by that."""
    from mcp_context.plan.cost import Prediction, host_issue_seconds
    from mcp_context.plan.dryrun import RankTraffic
    from mcp_context.masks import CAUSAL_BLOCK, FULL_BLOCK
    from mcp_context.schedule import BlockTask

    busy = RankTraffic(0, {}, {}, tasks=((BlockTask((0, 8), (0, 8), CAUSAL_BLOCK), BlockTask((0, 8), (8, 16), FULL_BLOCK)),
                                         (BlockTask((0, 8), (16, 24), FULL_BLOCK), BlockTask((0, 0), (24, 32), FULL_BLOCK))))
    idle = RankTraffic(1, {}, {}, tasks=((BlockTask((0, 8), (0, 8), CAUSAL_BLOCK),), ()))
    assert host_issue_seconds(h100, [idle, busy]) == pytest.approx((h100.host_layer_us + 3 * h100.host_call_us) * 1e-6)
    gpu_bound, host_bound = (Prediction(0.004, 0.008, 0.004, 0.008, 0.012, host_s=h) for h in (0.005, 0.020))
    assert gpu_bound.bound_s == 0.012 and host_bound.bound_s == 0.020
    short = plan(_request(h100, seq=64, gpus=4))  # 16 tokens a rank: every layout waits for its host
    assert all(r.prediction.bound_s == r.prediction.host_s > r.prediction.total_s for r in short.rows)
    assert any(r.startswith("host-bound: issuing the layer takes the host") for r in short.reasons), short.reasons


def test_the_host_figures_are_fitted_to_the_h200_steps_timed_with_the_host_ahead():
    """The shipped H200 profile's host_layer_us and host_call_us are tools/calibrate_profile.py's fit to run 4's
    12 steps (2 to 8 calls), and the line predicts each of them within 30 % (the host's time scatters between
    runs of one step: 7.75 and 11.31 ms for p2p at 32K/P8 in runs 4 and 3); one call count alone is refused."""
    from mcp_context.plan.cost import host_seconds
    from tools.calibrate_profile import _lines, fit_host, host_steps

    steps = host_steps(_lines(DOCS_GPU / "h200_run4_bench_32k.jsonl") + _lines(DOCS_GPU / "h200_run4_picks.jsonl"))
    assert len(steps) == 12 and {c for c, _ in steps} == {2, 3, 8}
    shipped = load_profile("h200_nvlink_ib")
    assert fit_host(steps) == (shipped.host_layer_us, shipped.host_call_us)
    for calls, seconds in steps:
        assert host_seconds(shipped, calls) == pytest.approx(seconds, rel=0.3)
    with pytest.raises(ValueError, match="at least two call counts"):
        fit_host([(8, 0.009), (8, 0.010)])


def test_the_h200_profile_predicts_the_steps_measured_on_this_engine_within_10_percent():
    """Run 4 (H200, main fd488ae: the ring walked by its member, results held as their rows need) measured the
    32K/P8 p2p step cold at 9.50 ms, and the picks at 128K with an all-to-all of 2 or none. The shipped profile,
    fitted to run 1's steps and run 4's host times, predicts each as the longer of its GPU time and the host's
    issue time (``Prediction.bound_s``) within 10 %: 9.33 ms at 32K/P8, where the host is the bound, and
    1.02-1.06 of the measured time at 128K."""
    import statistics

    from mcp_context.plan.cost import host_seconds
    from tools.calibrate_profile import _lines, predicted_step

    profile = load_profile("h200_nvlink_ib")
    heads = {"llama3_8b": (32, 8), "llama3_70b": (64, 8)}
    steps = [(r["comm"], r["seq_len"], r["world_size"], 32, 8, r)
             for r in _lines(DOCS_GPU / "h200_run4_bench_32k.jsonl") if r.get("part") == "rank_schedule"]
    steps += [(r["comm"], r["seq_len"], r["cp"], *heads[r["model"]], r["step"])
              for r in _lines(DOCS_GPU / "h200_run4_picks.jsonl")
              if r.get("part") == "pick" and "step" in r and r["sizes"][0] in (2, r["cp"])]  # predicted_step's a2a of 2
    assert {(s, p) for _, s, p, *_ in steps} == {(32768, 8), (131072, 8), (131072, 16)} and len(steps) == 5
    for comm, seq_len, cp, h, hk, step in steps:
        gpu = predicted_step(profile, comm, seq_len, cp, h, hk, 128, harness=2)[0]
        host = host_seconds(profile, step["attention_calls"])
        measured = statistics.median(step["fwd_bwd"]["ours_s"])
        assert max(gpu, host) == pytest.approx(measured, rel=0.10), (comm, seq_len, cp, gpu, host, measured)


def test_a_plan_logged_to_a_file_says_how_far_it_is(h100, capsys, monkeypatch):
    """stderr not a terminal (a batch job's log, as under pytest): no bar, a plain line at most every
    ``LOG_LINE_SECONDS`` (0 here: one per candidate but the last), counting the candidates."""
    from mcp_context.plan import planner

    monkeypatch.setattr(planner, "LOG_LINE_SECONDS", 0.0)
    done = plan(dataclasses.replace(_request(h100, seq=64, gpus=4), cp_sizes=(2,)), progress=None)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dry runs:")]
    n = len(done.rows)
    assert n > 1 and [line.split(",")[0] for line in lines] == [f"dry runs: {i}/{n} candidates" for i in range(1, n)]


@pytest.mark.parametrize("mask", [BlockMask(None, 0), BlockMask(), BlockMask(0, None), BlockMask(-300, 0),
                                  BlockMask(-100, 50, 2), BlockMask(None, 0, 3), BlockMask(5, None), BlockMask(None, -700)])
@pytest.mark.parametrize("n,m", [(384, 384), (600, 300), (96, 900)])
def test_tile_loads_and_computed_pairs_count_the_visible_tiles(mask, n, m):
    """Per 64-row tile of one diagonal sub-block: the key tiles from the first to the last visible key
    (``tile_loads``), and the pairs of those tiles (``computed_pairs``, every sub-block), both counted from
    ``visible()``; ``transposed`` is ``visible()``'s transpose."""
    if n % mask.diagonal or m % mask.diagonal:
        pytest.skip("the block does not hold the diagonal's equal sub-blocks")
    tile, visible = 64, mask.visible(n, m)
    sn, sm = n // mask.diagonal, m // mask.diagonal
    loads, computed = [], 0
    for r in range(0, sn, tile):
        keys = visible[r:r + tile, :sm].any(0).nonzero().flatten()
        k0, k1 = (int(keys.min()) // tile, -(-(int(keys.max()) + 1) // tile)) if len(keys) else (0, 0)
        loads.append(k1 - k0)
        computed += min(tile, sn - r) * (min(sm, k1 * tile) - k0 * tile)
    assert mask.tile_loads(n, m, tile) == loads
    assert mask.computed_pairs(n, m, tile) == mask.diagonal * computed
    assert torch.equal(mask.transposed.visible(m, n), visible.T)


def test_a_call_too_small_to_fill_the_gpu_costs_its_idle_sms():
    """``occupancy``: a thread block per 128-row tile (query tiles forward, key tiles backward); the share of
    132 SMs kept busy is the blocks' work over 132 times the busiest block's. Every row of both shipped
    profiles' tables, at their 32 heads, fills the GPU both ways (the model adds nothing to what the tables
    measured); Llama-3-8B's calls at 32K over 64 ranks (cp8x8: 4 heads, 2048 query rows) do not."""
    from mcp_context.masks import CAUSAL_BLOCK, FULL_BLOCK
    from mcp_context.plan.cost import occupancy
    from mcp_context.schedule import BlockTask

    for name in ("h100_nvlink_ib", "h200_nvlink_ib"):
        profile = load_profile(name)
        assert (profile.sm_count, profile.attention_tile_rows) == (132, 128)
        for length, _, _ in profile.causal_tflops:
            n = int(length)
            assert occupancy(profile, BlockTask((0, n), (0, n), CAUSAL_BLOCK), 32) == (1.0, 1.0), (name, n)
        for length, _, _ in profile.full_tflops:  # sqrt(2 pairs): the squares of half that many pairs
            n = int(length / 2 ** 0.5)
            assert occupancy(profile, BlockTask((0, n), (0, n), FULL_BLOCK), 32) == (1.0, 1.0), (name, n)
    h200 = load_profile("h200_nvlink_ib")
    # 4 heads x 16 query tiles of equal work (a full block against 30720 keys): 64 of 132 SMs forward;
    # backward 240 key tiles of 16 query tiles each: 960 blocks, full
    assert occupancy(h200, BlockTask((0, 2048), (0, 30720), FULL_BLOCK), 4) == (pytest.approx(64 / 132), 1.0)
    # a causal square of 2048 rows: tiles see 1..16 key tiles (136 in all, the busiest 16), both ways
    assert occupancy(h200, BlockTask((0, 2048), (0, 2048), CAUSAL_BLOCK), 4) == (
        pytest.approx(4 * 136 / (132 * 16)),) * 2
    assert occupancy(h200, BlockTask((0, 2048), (0, 2048), CAUSAL_BLOCK), 16) == (1.0, 1.0)
    # a diagonal run of 4 squares runs as a batch of 4
    assert occupancy(h200, BlockTask((0, 2048), (0, 2048), BlockMask(None, 0, 4)), 4) == (
        pytest.approx(4 * 4 * 10 / (132 * 4)),) * 2
    # the same FLOPs over 8 heads (128 blocks) or 4 (64 blocks): twice the forward time, the same backward
    fuller, idler = (call_seconds(h200, BlockTask((0, 2048), (0, 30720), FULL_BLOCK), 1024, h) for h in (8, 4))
    overhead = h200.call_overhead_us * 1e-6
    assert idler[0] - overhead == pytest.approx(2 * (fuller[0] - overhead), rel=1e-12) and idler[1] == fuller[1]


def test_occupancy_brings_the_short_picks_gpu_time_within_15_percent_of_the_h200s():
    """The picks run 4 timed with the host ahead (their GPU time), predicted by the shipped H200 profile: with
    the occupancy model every one within 15 % (Llama-3-8B at 32K/P64, 4 heads a call: +12.8 %); without it
    (``sm_count`` 1: every call fills its GPU) that cell is predicted 22 % short."""
    from tools.calibrate_profile import _lines, fit_gpu_time, gpu_bound_rows

    rows = _lines(DOCS_GPU / "h200_run4_picks.jsonl") + _lines(DOCS_GPU / "h200_run4_bench_32k.jsonl")
    profile = load_profile("h200_nvlink_ib")
    with_fill = gpu_bound_rows(profile, rows)
    assert len(with_fill) == 12
    worst = max(with_fill, key=lambda r: abs(r["error"]))
    assert abs(worst["error"]) <= 0.15, worst
    without = gpu_bound_rows(dataclasses.replace(profile, sm_count=1), rows)
    short = [(a, b) for a, b in zip(with_fill, without) if (a["cp"], a["heads"], a["seq_len"]) == (64, 32, 32768)]
    assert len(short) == 1 and short[0][1]["error"] < -0.2 < 0 < short[0][0]["error"] < 0.15, short
    # fitting a rate scale and a per-call overhead to these GPU times: with occupancy every step within 5 % at
    # 18.6 us a call; without it the best fit misses by 12 % and needs 79 us a call
    scale, overhead, worst = fit_gpu_time(with_fill)
    assert (round(scale, 3), round(overhead, 1)) == (0.945, 18.6) and worst < 0.05
    scale, overhead, worst = fit_gpu_time(without)
    assert overhead > 70 and worst > 0.12


def test_a_plan_whose_calls_cannot_fill_the_gpu_says_so_and_names_the_graphs_for_a_host_bound_local_step():
    """Llama-3-8B heads, 4096 tokens over 8 H200s (512 a rank, as 32K over 64): the pick, cp8 a2a, runs one
    causal square of 4096 rows and 4 heads a rank, whose 128 thread blocks (busiest 32 tiles, 528 in all)
    keep the SMs busy exactly half the time; the plan says so, and that its host-bound step can be replayed
    from CUDA graphs. A ring cannot (``replayable`` False); at 128K over 8 every call fills the GPU."""
    from tools.plan_grid import MODELS

    short = plan(PlanRequest(MODELS["llama3_8b"], 4096, 8, load_profile("h200_nvlink_ib"), cp_sizes=(8,)),
                 dry_run_all=True)
    best = short.recommended
    assert best.candidate.comm == "a2a" and best.replayable
    assert best.prediction.busy == pytest.approx(4 * 528 / (132 * 32), rel=1e-12)
    host = [r for r in short.reasons if r.startswith("host-bound")]
    assert len(host) == 1 and "model.cp_step_graphs=true" in host[0], short.reasons
    assert any(r.startswith("its attention calls are too small to fill the GPU: its SMs are busy 50%")
               for r in short.reasons), short.reasons
    assert {r.candidate.comm: r.replayable for r in short.rows} == {
        "a2a": True, "all_gather": True, "a2a+all_gather": True, "p2p": False, "a2a+p2p": False}
    long_ = evaluate(PlanRequest(MODELS["llama3_8b"], 131072, 8, load_profile("h200_nvlink_ib")),
                     Candidate(8, (8,), "p2p", "zigzag"))
    assert long_.prediction.busy == 1.0 and not long_.replayable


def test_the_occupancy_rows_a_gpu_measures_check_the_model():
    """tools/kernel_rates.py's ``occupancy`` part (the short picks' calls at 4 to 32 heads) rehearsed on CPU
    tensors with CUDA's events, sleep and synchronise answered on the host: one row per shape and head count,
    with the GPU times calibrate_profile reads. calibrate_profile's ``occupancy_rows`` gives, per row, the busy
    share measured (FLOP rate per head over the most heads') beside the model's: equal for times the model
    predicts, and apart for times that scale perfectly with heads (the check can fail)."""
    import statistics
    import sys

    sys.path.insert(0, str(REPO))
    from mcp_context.kernels.torch_sdpa import cpu_flash_kernel
    from mcp_context.masks import CAUSAL_BLOCK, FULL_BLOCK
    from mcp_context.plan.cost import occupancy
    from mcp_context.schedule import BlockTask
    from tests.test_bench_device import cuda_timing_on_host
    from tools.calibrate_profile import occupancy_rows
    from tools.kernel_rates import time_occupancy

    rows = []
    with cuda_timing_on_host():
        time_occupancy(rows.append, cpu_flash_kernel(), 32, 8, 8, 1, rand=lambda *s: torch.randn(*s),
                       shapes=((16, 48, FULL_BLOCK), (32, 32, CAUSAL_BLOCK)), head_counts=(4, 32))
    assert [(r["part"], r["rows"], r["heads"], r["kv_heads"]) for r in rows] == [
        ("occupancy", 16, 4, 1), ("occupancy", 16, 32, 8), ("occupancy", 32, 4, 1), ("occupancy", 32, 32, 8)]
    assert all(len(r["queued_fwd_s"]) == len(r["queued_fwd_bwd_s"]) == 1 and "host_ahead" in r for r in rows)
    assert len(occupancy_rows(load_profile("h200_nvlink_ib"), rows)) == 4

    h200 = load_profile("h200_nvlink_ib")
    shape = (2048, 30720, "full")
    task = BlockTask((0, 2048), (0, 30720), FULL_BLOCK)

    def row(heads: int, fwd_per_head: float, bwd_per_head: float) -> dict:
        return {"part": "occupancy", "rows": shape[0], "keys": shape[1], "mask": shape[2], "heads": heads,
                "fwd_s": [1.0], "fwd_bwd_s": [1.0], "queued_fwd_s": [fwd_per_head * heads],
                "queued_fwd_bwd_s": [(fwd_per_head + bwd_per_head) * heads]}

    shares = {h: occupancy(h200, task, h) for h in (4, 8, 32)}
    as_modelled = occupancy_rows(h200, [row(h, 1e-4 / f, 3e-4 / b) for h, (f, b) in shares.items()])
    assert [(r["heads"], r["measured_fwd"], r["model_fwd"]) for r in as_modelled] == [
        (4, pytest.approx(64 / 132), pytest.approx(64 / 132)), (8, pytest.approx(128 / 132), pytest.approx(128 / 132)),
        (32, 1.0, 1.0)]
    assert all(r["measured_bwd"] == pytest.approx(r["model_bwd"]) for r in as_modelled)
    scaling = occupancy_rows(h200, [row(h, 1e-4, 3e-4) for h in (4, 8, 32)])
    assert scaling[0]["measured_fwd"] == pytest.approx(1.0) and abs(scaling[0]["model_fwd"] - 1.0) > 0.5
    assert statistics.median(r["measured_bwd"] for r in scaling) == pytest.approx(1.0)


def test_calls_sized_to_the_gpu_are_what_the_planner_prices_for_the_short_pick():
    """Llama-3-8B at 32K over 64 H200s, the pick ``cp8x8 a2a+all_gather``, rank 0 (4 heads, 4096 query rows): its
    two 2048-row squares stacked into one call each way and its full block's forward in 2 key runs (64 blocks
    each, 128 together, on 132 SMs), predicted 1.12 ms of GPU time where one call per task (run 4's engine,
    measured 1.38 ms) is predicted 1.56 ms; every call of a step that fills the GPU stays as it was."""
    from mcp_context.algorithms.calls import Call, step_calls
    from mcp_context.kernels.torch_sdpa import cpu_flash_kernel
    from tools.calibrate_profile import predicted_step
    from tools.rank_step import rank_step

    h200 = load_profile("h200_nvlink_ib")
    step = rank_step("a2a+all_gather", 64, 32768, CAUSAL, cpu_flash_kernel(), 32, 8, 128, inner=8)
    tasks = tuple(step.plan.tasks[0])
    assert step_calls(tasks, step.heads, h200.gpu, True) == (Call((0, 2)), Call((1,), 2))
    assert step_calls(tasks, step.heads, h200.gpu, False) == (Call((0, 2)), Call((1,)))
    assert step_calls(tasks, 32, h200.gpu, True) == (Call((0,)), Call((1,)), Call((2,)))  # 32 heads fill it
    one_each, planned = (predicted_step(h200, "a2a+all_gather", 32768, 64, 32, 8, 128, harness, 8)[0]
                         for harness in (2, 3))
    assert one_each == pytest.approx(1.56e-3, rel=0.01) and planned == pytest.approx(1.12e-3, rel=0.02)
    p8 = [predicted_step(h200, "p2p", 32768, 8, 32, 8, 128, harness)[0] for harness in (2, 3)]
    assert p8[0] == p8[1]  # 4096 rows of 32 heads a call: nothing to size


def test_calibrate_profile_refuses_rates_without_profile_rows_in_one_line(tmp_path, capsys):
    """Rates that hold only occupancy rows (``kernel_rates.py --parts occupancy``) cannot fit the step bandwidth:
    one line naming what is missing and what writes it, exit status 2, not a statistics traceback."""
    import sys

    sys.path.insert(0, str(REPO))
    from tools.calibrate_profile import main as calibrate_main

    rates = tmp_path / "rates.jsonl"
    rates.write_text(json.dumps({"part": "occupancy", "rows": 2048, "keys": 2048, "mask": "causal", "heads": 4,
                                 "fwd_s": [1e-4], "fwd_bwd_s": [4e-4]}) + "\n")
    assert calibrate_main(["--profile", "h200_nvlink_ib", "--rates", str(rates),
                           "--bench", str(DOCS_GPU / "h200_run1_bench.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no 'profile' rows" in err and "kernel_rates.py --parts profile" in err, err


def test_the_grid_tool_lists_each_cells_pick_with_its_busy_share_and_replayability():
    """tools/plan_grid.py's row for one cell (Llama-3-8B heads, 32K over 8): the pick is the fastest of the
    zigzag candidates it evaluated (its ms the least of every scheme's best), its calls fill the GPU (busy 1),
    and a ring pick cannot be replayed from CUDA graphs."""
    import sys

    sys.path.insert(0, str(REPO))
    from tools.plan_grid import grid

    [row] = grid("h200_nvlink_ib", [32768], [8], ["llama3_8b"])
    assert row["predicted_ms"] == min(v["ms"] for v in row["best_per_scheme"].values())
    assert row["best_per_scheme"][row["comm"]]["candidate"] == row["pick"]
    assert row["busy"] == 1.0 and row["replayable"] == (row["comm"] in ("a2a", "all_gather", "a2a+all_gather"))
    assert row["efficiency"] == pytest.approx(row["fused_equal_flops_ms"] / row["predicted_ms"])


def test_candidates_that_run_alike_are_dry_run_once_with_the_figures_each_would_get(h100, monkeypatch):
    """a2a+p2p and a2a+all_gather at [2, 2, 2] and [2, 4] run the same step (the ring spans the outer levels
    flattened): the planner dry-runs one of each kind and gives both rows the figures evaluating each gives."""
    import mcp_context.plan.planner as planner

    req = dataclasses.replace(_request(h100, seq=128, gpus=8), cp_sizes=(8,))
    calls = []
    evaluate_ = planner.evaluate
    monkeypatch.setattr(planner, "evaluate", lambda r, cand, *a: calls.append(cand) or evaluate_(r, cand, *a))
    rows = plan(req).rows
    labels = {r.candidate.label() for r in rows}
    assert {"cp2x2x2 a2a+p2p zigzag", "cp2x4 a2a+p2p zigzag"} <= labels
    assert len(calls) < len(rows) and len({planner.runs_alike(c) for c in calls}) == len(calls)
    shared = [row for row in rows if row.candidate not in calls]
    assert shared and all(row == evaluate_(req, row.candidate) for row in shared)


def test_a_layout_whose_host_time_alone_rules_it_out_is_not_dry_run_and_the_pick_stays(capsys):
    """A narrow window over 4 ranks: striped layouts split it into many calls, so issuing them alone takes the
    host more than ``SKIP_ABOVE`` times the fastest layout's time. Those are not dry-run; every candidate's bound
    is its row's host time exactly, and below its time per sequence; the rows that are dry-run, their order, the
    pick and its comparisons are what dry-running every candidate (``--dry-run-all``) gives; the table, the
    reasons and the JSON list the skipped ones with their bounds."""
    from mcp_context.plan.__main__ import _parser, _request as cli_request
    from mcp_context.plan.planner import SKIP_ABOVE, host_bound
    from mcp_context.plan.report import plan_dict

    args = ["--layers", "2", "--hidden", str(H * D), "--heads", str(H), "--kv-heads", "2", "--head-dim", str(D),
            "--ffn-hidden", "64", "--vocab", "256", "--seq-len", "256", "--gpus", "4", "--cp-sizes", "4",
            "--window-size", "7,0", "--micro-batch-size", str(B), "--no-progress", "--json", "-"]
    req = cli_request(_parser().parse_args(args))
    assert main(args + ["--dry-run-all"]) == 0
    every = json.loads(capsys.readouterr().out)
    fewer = plan(req)
    assert every["not_dry_run"] == [] and len(every["candidates"]) == len(fewer.rows) + len(fewer.skipped)
    skipped = {b.candidate.label() for b in fewer.skipped}
    assert any(b.candidate.layout == "striped" for b in fewer.skipped)
    for row in every["candidates"]:
        cand = Candidate(row["context_parallel_size"], tuple(row["hierarchical_context_parallel_sizes"]),
                         row["cp_comm_type"], row["layout"])
        bound = host_bound(req, cand)
        assert bound.host_s == row["predicted_seconds_per_layer"]["host"]
        assert bound.seconds_per_sequence <= row["seconds_per_sequence_per_layer"]
    best = fewer.recommended.seconds_per_sequence
    assert all(b.seconds_per_sequence > SKIP_ABOVE * best for b in fewer.skipped)
    assert [b.seconds_per_sequence for b in fewer.skipped] == sorted(b.seconds_per_sequence for b in fewer.skipped)
    shown = plan_dict(fewer)
    assert [r for r in every["candidates"] if Candidate(r["context_parallel_size"], tuple(
        r["hierarchical_context_parallel_sizes"]), r["cp_comm_type"], r["layout"]).label() not in skipped
            ] == shown["candidates"]
    assert every["recommended"] == shown["recommended"] and every["reasons"][1:] == fewer.reasons[1:-1]
    fitting = sum(r.fits for r in fewer.rows)
    assert fewer.reasons[0].startswith(f"fastest attention per sequence among the {fitting} dry-run layouts that fit")
    assert fewer.reasons[-1].startswith(f"{len(skipped)} layouts not dry-run: issuing their attention calls alone ")
    assert f"{len(skipped)} layouts not dry-run" in plan_table(fewer)
    first = fewer.skipped[0]
    assert len(shown["not_dry_run"]) == len(skipped) and shown["not_dry_run"][0] == {
        "context_parallel_size": 4, "hierarchical_context_parallel_sizes": list(first.candidate.sizes),
        "cp_comm_type": first.candidate.comm, "layout": first.candidate.layout, "data_parallel_size": 1,
        "attention_calls": first.calls, "host_seconds_per_layer": first.host_s,
        "seconds_per_sequence_per_layer_at_least": first.seconds_per_sequence}
