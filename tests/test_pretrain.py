"""The pretrain entry: CP-independent losses, exact resume, safe checkpoint writes, early recipe errors.

The runs train the tiny recipe (2 layers, seq 256, global batch 8, fp32, gloo), mostly on a world of
4 ranks. The reference is the same recipe at CP=1 (DP=4: every rank attends over whole sequences):
at CP=4 as [2, 2] (a2a+p2p, DP=1) the per-step losses, gradient norms (before clipping) and
validation losses agree within 1e-4 relative (measured: <= 1.3e-7), and the weights after step 3
within 1e-4 absolute (measured: 8.5e-6; Adam's update of a nearly-zero gradient amplifies fp32
round-off). Resumed runs (same CP; CP=2 with DP=2; a torchrun job of 2 ranks killed with SIGKILL and
relaunched) repeat the uninterrupted run's losses within 1e-4 relative. An interrupted checkpoint
write (at CP=2 over 2 ranks) leaves ``latest`` on the previous checkpoint, which loads and continues the run exactly. Bad
recipes fail in the launcher's checks with the key named, and no process group is ever started.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed

REPO = Path(__file__).resolve().parents[1]
REL = 1e-4
STEPS = 6
# The tiny recipe with a short schedule that does not depend on train.steps (so runs of 3, 4 and 6
# steps share their first steps' learning rates) and warm-up 0 (step 1 already updates the weights).
COMMON = ["train.lr_warmup_iters=0", f"train.lr_decay_iters={STEPS}", "train.eval_interval=3", "train.eval_iters=1"]
CP1 = ["model.context_parallel_size=1", "model.hierarchical_context_parallel_sizes=null", "model.cp_comm_type=p2p"]
CP2 = ["model.context_parallel_size=2", "model.hierarchical_context_parallel_sizes=null", "model.cp_comm_type=p2p"]
HCP4 = ["model.context_parallel_size=4", "model.hierarchical_context_parallel_sizes=[2, 2]",
        "model.cp_comm_type=a2a+p2p"]


class _Interrupted(Exception):
    """Stands in for a crash (the process dying) at a chosen point of a run."""


def _train(rank, world, run_dir, overrides, save=True, crash_before_step=None, crash_in_save_of_step=None,
           skip_pointer_of_step=None, weights_of_step=3):
    """Train the tiny recipe with ``overrides``; return (records, rank 0's weights after ``weights_of_step``).

    ``crash_before_step``: every rank raises when that step starts (after the earlier checkpoints).
    ``crash_in_save_of_step``: every rank raises inside that step's checkpoint write, after
    megatron-core has written its files into the temporary directory and before the rename.
    ``skip_pointer_of_step``: that step's checkpoint is renamed into place but ``latest`` is not
    updated (what a crash between the two leaves on disk).
    """
    from megatron.core import dist_checkpointing

    from mcp_context.pretrain import checkpoint, loop
    from mcp_context.pretrain.launch import check_recipe_for_training, resolve_run_dir
    from mcp_context.recipes import load_recipe

    cfg = load_recipe(REPO / "recipes" / "tiny_cpu.yaml", [*overrides, "train.device=cpu"])
    run_dir = resolve_run_dir(cfg, run_dir)
    if not save:
        cfg.checkpoint.save = None
    check_recipe_for_training(cfg, world)
    original_step, original_save = loop.train_step, dist_checkpointing.save
    weights = {}

    def train_step(model, optimizer, scheduler, micro_batches, device, dynamic=None):
        step = scheduler.num_steps + 1
        if step == crash_before_step:
            raise _Interrupted
        record = original_step(model, optimizer, scheduler, micro_batches, device, dynamic)
        if step == weights_of_step and rank == 0:
            weights.update({n: p.detach().clone() for n, p in model.module.named_parameters()})
        return record

    def save(state, path, **kwargs):
        original_save(state, path, **kwargs)
        if state["step"] == crash_in_save_of_step:
            raise _Interrupted

    original_write_atomic = checkpoint.write_atomic

    def write_atomic(path, data):
        if data.decode() != checkpoint.checkpoint_name(skip_pointer_of_step or 0):
            original_write_atomic(path, data)

    loop.train_step, dist_checkpointing.save, checkpoint.write_atomic = train_step, save, write_atomic
    try:
        records = loop.train(cfg, run_dir).records
    except _Interrupted:
        records = None
    finally:
        loop.train_step, dist_checkpointing.save, checkpoint.write_atomic = (original_step, original_save,
                                                                           original_write_atomic)
    return records, weights


def _records(per_rank_results):
    """Rank 0's per-step records, after checking that every rank reported the same numbers."""
    timing = ("tokens_per_s", "step_time_s")
    per_rank = [[{k: v for k, v in rec.items() if k not in timing} for rec in records]
                for records, _ in per_rank_results]
    assert all(records == per_rank[0] for records in per_rank), per_rank
    return per_rank[0]


def _assert_same_steps(records, reference, keys=("loss", "grad_norm", "lr", "val_loss")):
    ref = {r["step"]: r for r in reference}
    for rec in records:
        for key in keys:
            if key in rec or key in ref[rec["step"]]:
                assert rec[key] == pytest.approx(ref[rec["step"]][key], rel=REL), (rec["step"], key)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pretrain_data")


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    """The tiny recipe at CP=4 as [2, 2] for 6 steps without interruption: (records, final weights)."""
    run_dir = str(tmp_path_factory.mktemp("uninterrupted"))
    results = run_distributed(4, _train, run_dir, COMMON + HCP4 + [f"train.steps={STEPS}",
                                                                     f"data.cache_dir={data_dir}"], False)
    return _records(results), results[0][1]


def _rank_grads(rank):
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(5, 3, generator=generator) * (rank + 1), torch.randn(7, generator=generator)]


def _clip_with_megatron_on_cpu(rank, world):
    import torch.distributed as dist
    from megatron.core.optimizer import clip_grads

    from megatron_patches.cpu_training import apply_cpu_training_shims

    apply_cpu_training_shims("cpu")
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in _rank_grads(rank)]
    for param, grad in zip(params, _rank_grads(rank)):
        param.grad = grad
    norm = clip_grads.get_grad_norm_fp32([p.grad for p in params], grad_stats_parallel_group=dist.group.WORLD)
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
    return norm, [p.grad for p in params]


def test_cpu_training_shims_give_megatron_grad_norm_and_clipping_on_cpu():
    results = run_distributed(2, _clip_with_megatron_on_cpu)
    grads = [_rank_grads(r) for r in range(2)]
    norm = torch.cat([g.flatten() for rank_grads in grads for g in rank_grads]).double().norm().item()
    for rank, (got_norm, clipped) in enumerate(results):
        assert got_norm == pytest.approx(norm, rel=1e-6)
        for got, grad in zip(clipped, grads[rank]):
            torch.testing.assert_close(got, grad / (norm + 1e-6), rtol=1e-6, atol=0)


def test_micro_batch_sampler_reads_the_same_global_batch_at_every_dp_size():
    from mcp_context.pretrain.batches import MicroBatchSampler

    for dp in (1, 2, 4):
        samplers = [MicroBatchSampler(3, 5, 8, 2, dp_rank=d, dp_size=dp) for d in range(dp)]
        steps = [[], []]
        for sampler in samplers:
            micro = list(sampler)
            assert len(micro) == len(sampler) == 2 * 8 // dp // 2
            half = len(micro) // 2
            steps[0] += [i for mb in micro[:half] for i in mb]
            steps[1] += [i for mb in micro[half:] for i in mb]
        assert steps == [list(range(24, 32)), list(range(32, 40))]


def test_cp4_hierarchical_matches_cp1_losses_grad_norms_and_weights(uninterrupted, data_dir, tmp_path):
    reference = run_distributed(4, _train, str(tmp_path), COMMON + CP1 + ["train.steps=3",
                                                                          f"data.cache_dir={data_dir}"], False)
    records, weights = uninterrupted
    ref_records, ref_weights = _records(reference), reference[0][1]
    assert [r["step"] for r in ref_records] == [1, 2, 3] and "val_loss" in ref_records[2]
    _assert_same_steps(records[:3], ref_records)
    assert records[2]["loss"] < records[0]["loss"] - 0.1  # it trains
    assert weights.keys() == ref_weights.keys()
    for name, ref in ref_weights.items():  # after step 3
        torch.testing.assert_close(weights[name], ref, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("resume_layout", [HCP4, CP2], ids=["same_cp4_hierarchical", "cp2_dp2"])
def test_resume_after_crash_repeats_the_uninterrupted_losses(uninterrupted, data_dir, tmp_path, resume_layout):
    from mcp_context.pretrain.checkpoint import latest_checkpoint
    from mcp_context.pretrain.metrics import read_metrics

    overrides = COMMON + [f"train.steps={STEPS}", "checkpoint.save_interval=3", f"data.cache_dir={data_dir}"]
    crashed = run_distributed(4, _train, str(tmp_path), overrides + HCP4, True, 5)
    assert all(records is None for records, _ in crashed)
    assert latest_checkpoint(tmp_path / "checkpoints").name == "iter_0000003"
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]

    resumed = _records(run_distributed(4, _train, str(tmp_path), overrides + resume_layout))
    assert [r["step"] for r in resumed] == [4, 5, 6]
    _assert_same_steps(resumed, uninterrupted[0])
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert latest_checkpoint(tmp_path / "checkpoints").name == "iter_0000006"


@pytest.mark.parametrize("crash", ["before_rename", "before_pointer"])
def test_interrupted_checkpoint_write_leaves_previous_checkpoint_loadable(uninterrupted, data_dir, tmp_path, crash):
    from mcp_context.pretrain.checkpoint import latest_checkpoint

    overrides = COMMON + CP2 + ["train.world_size=2", "train.steps=4", "checkpoint.save_interval=2",
                                f"data.cache_dir={data_dir}"]
    if crash == "before_rename":
        crashed = run_distributed(2, _train, str(tmp_path), overrides, True, None, 4)
        assert all(records is None for records, _ in crashed)
    else:
        run_distributed(2, _train, str(tmp_path), overrides, True, None, None, 4)
    ckpts = tmp_path / "checkpoints"
    assert latest_checkpoint(ckpts).name == "iter_0000002"
    if crash == "before_rename":
        assert not (ckpts / "iter_0000004").exists()
        assert (ckpts / "iter_0000004.tmp" / "metadata.json").exists()  # megatron-core's files, never renamed
    else:
        assert (ckpts / "iter_0000004" / "metadata.json").exists()  # complete, but newer than latest

    resumed = _records(run_distributed(2, _train, str(tmp_path), overrides))
    assert [r["step"] for r in resumed] == [3, 4]
    _assert_same_steps(resumed, uninterrupted[0], keys=("loss", "grad_norm", "lr"))
    assert latest_checkpoint(ckpts).name == "iter_0000004" and not (ckpts / "iter_0000004.tmp").exists()


def _torchrun(nproc, run_dir, overrides):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "tools/pretrain.py",
            "--recipe", "recipes/tiny_cpu.yaml", "--run-dir", str(run_dir), "train.device=cpu", *overrides]


def _process_tree(pid):
    """``pid`` and all its descendants (read from /proc: torchrun starts its ranks in their own sessions)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks to kill through /proc (Linux)")
def test_sigkill_mid_run_then_resume_repeats_the_uninterrupted_losses(uninterrupted, data_dir, tmp_path):
    from mcp_context.pretrain.checkpoint import latest_checkpoint
    from mcp_context.pretrain.metrics import read_metrics

    steps = STEPS  # killed at its first checkpoint (step 2 here), far from the end
    overrides = COMMON + CP2 + [f"train.steps={steps}", "train.world_size=2", "checkpoint.save_interval=2",
                                f"data.cache_dir={data_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(_torchrun(2, tmp_path, overrides), cwd=REPO, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (tmp_path / "checkpoints" / "latest").exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in _process_tree(run.pid):  # torchrun and both ranks, wherever they are (a save may be half written)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    run.wait()
    killed_at = int(latest_checkpoint(tmp_path / "checkpoints").name.split("_")[1])
    assert killed_at < steps, "the run finished before it was killed"

    resume = subprocess.run(_torchrun(2, tmp_path, overrides), cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert resume.returncode == 0, resume.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    _assert_same_steps(records, uninterrupted[0], keys=("loss", "grad_norm", "lr"))  # the CP=4 [2, 2] run's
    assert f"resumed from {tmp_path / 'checkpoints' / f'iter_{killed_at:07d}'} at step {killed_at}" in resume.stdout
    assert latest_checkpoint(tmp_path / "checkpoints").name == f"iter_{steps:07d}"


@pytest.mark.parametrize("overrides,key", [
    (["model.contex_parallel_size=4"], "model.contex_parallel_size"),
    (["train.steps=many"], "train.steps"),
    (["model.hierarchical_context_parallel_sizes=[3, 3]"], "model.hierarchical_context_parallel_sizes"),
    (["model.seq_length=260"], "model.seq_length"),
    (["model.pipeline_model_parallel_size=2", *CP2], "model.pipeline_model_parallel_size"),
    (["train.world_size=8"], "train.world_size"),
    (["checkpoint.load=/nonexistent/checkpoints"], "checkpoint.load"),
    (["checkpoint.save_interval=0"], "checkpoint.save_interval"),
])
def test_bad_recipe_fails_before_any_process_group(monkeypatch, capsys, overrides, key):
    import torch.distributed as dist

    from mcp_context.pretrain.cli import main

    def no_process_group(*args, **kwargs):
        raise AssertionError("a process group was started before the recipe was checked")

    monkeypatch.setattr(dist, "init_process_group", no_process_group)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["--recipe", str(REPO / "recipes" / "tiny_cpu.yaml"), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and key in err, err
    assert not dist.is_initialized()


def test_torchrun_entry_writes_metrics_recipe_and_checkpoint(data_dir, tmp_path):
    from mcp_context.pretrain.checkpoint import latest_checkpoint
    from mcp_context.pretrain.metrics import read_metrics
    from mcp_context.recipes import load_recipe

    overrides = ["train.world_size=2", "train.steps=2", "train.lr_warmup_iters=0", f"data.cache_dir={data_dir}",
                 *CP2]
    proc = subprocess.run(_torchrun(2, tmp_path, overrides), cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= record.keys()
        assert all(isinstance(v, (int, float)) and v == v for v in record.values())
    saved = load_recipe(tmp_path / "recipe.yaml")
    assert saved.train.steps == 2 and saved.model.context_parallel_size == 2
    assert saved.checkpoint.save == str(tmp_path / "checkpoints")
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    assert ckpt.name == "iter_0000002" and load_recipe(ckpt / "recipe.yaml") == saved
    assert f"metrics: {tmp_path / 'metrics.jsonl'}" in proc.stdout
    assert f"checkpoint: {ckpt}" in proc.stdout
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2
