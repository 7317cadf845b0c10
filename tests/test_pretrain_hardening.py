"""The pretrain entry against damaged and hostile run directories, diverging runs and a killed launcher.

One real run (the tiny recipe on 1 CPU rank, CP=1, 3 steps, a checkpoint every step) is made once;
each case damages a copy of it. What is checked: ``latest`` may only name an ``iter_NNNNNNN``
directory beside it; pickles planted in a checkpoint's ``.metadata``, ``common.pt`` or byte objects
are refused without running (and the planted payload does run through the unrestricted readers, so
the refusal is real); a damaged newest checkpoint is reported by file with the newest intact one
offered; checkpoints without ``latest`` refuse to start; a recipe that changes the run refuses to
resume, naming each key; a torn last line of ``metrics.jsonl`` is dropped on resume; a diverging run
stops before saving; ranks die with their launcher; ``train.device=cuda`` without CUDA is refused
before any process group.
"""
from __future__ import annotations

import io
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed
from tests.test_pretrain import CP1, REPO, _process_tree, _torchrun

ONE_RANK = ["train.world_size=1", *CP1, "train.lr_warmup_iters=0", "train.eval_iters=0"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _pretrain(run_dir, overrides, *flags):
    """``tools/pretrain.py`` on one CPU rank (no launcher) with the tiny recipe; the finished process."""
    return subprocess.run([sys.executable, "tools/pretrain.py", "--recipe", "recipes/tiny_cpu.yaml", "--run-dir",
                           str(run_dir), *flags, "train.device=cpu", *ONE_RANK, *overrides],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hardening_data")


@pytest.fixture(scope="module")
def finished_run(data_dir, tmp_path_factory):
    """A run directory with checkpoints after steps 1, 2 and 3 (``latest`` = iter_0000003)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = _pretrain(run_dir, ["train.steps=3", "checkpoint.save_interval=1", f"data.cache_dir={data_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture
def run(finished_run, tmp_path):
    """A copy of the finished run to damage, and its recipe (checkpoints in the copy)."""
    from mcp_context.recipes import load_recipe

    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    cfg = load_recipe(copy / "recipe.yaml")
    cfg.checkpoint.save = str(copy / "checkpoints")
    return copy, cfg


class _Exploit:
    """Unpickling it creates the directory ``target``: the stand-in for any code a payload would run."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return os.mkdir, (self.target,)


def _load_with_safe_strategies(rank, world, checkpoint_dir, object_key):
    """megatron-core's ``dist_checkpointing.load`` through ``safe_pickle.mcore_load_strategies`` (one rank);
    the error it raised, as text (None if it loaded)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from mcp_context import safe_pickle

    state = {} if object_key is None else {"obj": ShardedObject(object_key, None, (1,), (0,), replica_id=0)}
    sharded, common = safe_pickle.mcore_load_strategies()
    try:
        dist_checkpointing.load(state, str(checkpoint_dir), sharded_strategy=sharded, common_strategy=common)
    except BaseException as err:  # DCP wraps a rank's error in CheckpointException, a BaseException
        return f"{type(err).__name__}: {err}"
    return None


def _resume_error(cfg, **kwargs) -> str:
    from mcp_context.pretrain.checkpoint import CheckpointError, checkpoint_to_resume

    with pytest.raises(CheckpointError) as err:
        checkpoint_to_resume(cfg, **kwargs)
    return str(err.value)


@pytest.mark.parametrize("content", [
    b"/elsewhere/checkpoints/iter_0000003", b"../../other/checkpoints/iter_0000003", b"iter_0000003/../iter_0000002",
    b"iter_3", b"\x00\xffiter_0000003", b"",
], ids=["absolute", "dotdot", "dotdot_inside", "other_name", "binary", "empty"])
def test_latest_names_only_a_checkpoint_directory_beside_it(run, content):
    from mcp_context.pretrain.checkpoint import latest_checkpoint

    run_dir, cfg = run
    pointer = run_dir / "checkpoints" / "latest"
    pointer.write_bytes(content)
    message = _resume_error(cfg)
    assert message.startswith(f"{pointer} holds "), message
    assert "iter_NNNNNNN" in message and f"--resume-from {run_dir / 'checkpoints' / 'iter_0000003'}" in message
    assert "\n" not in message
    pointer.write_bytes(b"iter_0000003\n")  # the form the run writes (a trailing newline is accepted)
    assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "iter_0000003"


def test_latest_naming_a_symlink_to_another_run_is_refused(run, tmp_path):
    run_dir, cfg = run
    other = tmp_path / "other_iter"
    shutil.copytree(run_dir / "checkpoints" / "iter_0000001", other)
    (run_dir / "checkpoints" / "iter_0000009").symlink_to(other)
    (run_dir / "checkpoints" / "latest").write_text("iter_0000009")
    message = _resume_error(cfg)
    assert "iter_0000009" in message and "not a complete checkpoint directory" in message
    assert f"--resume-from {run_dir / 'checkpoints' / 'iter_0000003'}" in message


def test_planted_pickle_in_metadata_is_refused_without_running(run, tmp_path):
    """``.metadata`` is a plain pickle in every torch DCP we support; the planted one is refused by our
    resume check and by megatron-core's load through our strategies, on any torch (DCP's own handling
    of a reader's error differs between versions, so the strategy reads the metadata before DCP)."""
    run_dir, cfg = run
    newest = run_dir / "checkpoints" / "iter_0000003"
    target = tmp_path / "pwned"
    with open(newest / ".metadata", "wb") as f:
        pickle.dump(_Exploit(target), f)

    message = _resume_error(cfg)
    assert str(newest / ".metadata") in message and "posix.mkdir" in message and "refusing" in message
    assert f"--resume-from {run_dir / 'checkpoints' / 'iter_0000002'}" in message
    [error] = run_distributed(1, _load_with_safe_strategies, newest, None)
    assert error is not None and "posix.mkdir" in error, error
    assert not target.exists()

    with open(newest / ".metadata", "rb") as f:  # the payload is real: a plain unpickler runs it
        pickle.load(f)
    assert target.is_dir()


def test_planted_pickle_in_common_pt_and_in_a_byte_object_is_refused_without_running(run, tmp_path):
    from mcp_context import safe_pickle

    run_dir, cfg = run
    newest = run_dir / "checkpoints" / "iter_0000003"
    target = tmp_path / "pwned"
    torch.save(_Exploit(target), newest / "common.pt")
    message = _resume_error(cfg)
    assert f"{newest / 'common.pt'} is missing or damaged (UnpicklingError" in message
    assert not target.exists()

    # The RNG states (a megatron-core sharded object: torch.save bytes inside a .distcp) replaced by a payload.
    torch.save({}, newest / "common.pt")
    payload = io.BytesIO()
    torch.save([_Exploit(target)], payload)
    metadata = safe_pickle.load_dcp_metadata(newest / ".metadata")
    [index] = [i for i in metadata.storage_data if i.fqn == "rng_state/shard_0_1"]
    data = newest / metadata.storage_data[index].relative_path
    metadata.storage_data[index].offset, metadata.storage_data[index].length = data.stat().st_size, len(payload.getvalue())
    with open(data, "ab") as f:
        f.write(payload.getvalue())
    with open(newest / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    [error] = run_distributed(1, _load_with_safe_strategies, newest, "rng_state")
    assert error is not None and "Weights only load failed" in error, error
    assert not target.exists()
    torch.load(io.BytesIO(payload.getvalue()), weights_only=False)  # the payload is real
    assert target.is_dir()


def test_a_longer_run_on_a_finished_one_is_refused_by_the_launch_check_in_one_line(finished_run, data_dir, capsys):
    """``make train`` runs ``--check-launch`` before torchrun: a changed ``train.steps`` on a finished run
    ends there, status 2 and one error line (under torchrun the same refusal comes with the launcher's
    traceback); the unchanged run passes the check (it would resume and say there is nothing to do)."""
    from mcp_context.pretrain.cli import main

    args = ["--check-launch", "1", "--recipe", str(REPO / "recipes" / "tiny_cpu.yaml"), "--run-dir", str(finished_run),
            "train.device=cpu", *ONE_RANK, "checkpoint.save_interval=1", f"data.cache_dir={data_dir}"]
    assert main(args + ["train.steps=3"]) == 0, capsys.readouterr().err
    assert main(args + ["train.steps=4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: cannot resume from ") and "train.steps" in err, err


def test_checkpoints_without_latest_refuse_to_start(run):
    run_dir, cfg = run
    (run_dir / "checkpoints" / "latest").unlink()
    message = _resume_error(cfg)
    assert "iter_0000001, iter_0000002, iter_0000003" in message and "no latest file" in message
    assert f"--resume-from {run_dir / 'checkpoints' / 'iter_0000003'}" in message and "--restart" in message


@pytest.mark.parametrize("damage", ["truncated_distcp", "truncated_metadata", "missing_common", "missing_distcp"])
def test_damaged_newest_checkpoint_is_named_with_the_newest_intact_offered(run, damage):
    run_dir, cfg = run
    newest = run_dir / "checkpoints" / "iter_0000003"
    damaged = {"truncated_distcp": newest / "__0_0.distcp", "truncated_metadata": newest / ".metadata",
               "missing_common": newest / "common.pt", "missing_distcp": newest / "__0_0.distcp"}[damage]
    if damage.startswith("truncated"):
        with open(damaged, "r+b") as f:
            f.truncate(damaged.stat().st_size // 2)
    else:
        damaged.unlink()
    message = _resume_error(cfg)
    assert message.startswith(f"cannot resume from {newest}: {damaged}"), message
    assert f"--resume-from {run_dir / 'checkpoints' / 'iter_0000002'}" in message and "\n" not in message


def test_resume_refuses_recipe_changes_that_alter_the_run_and_allows_the_safe_ones(run):
    from mcp_context.pretrain.checkpoint import checkpoint_to_resume

    run_dir, cfg = run
    cfg.train.eval_interval, cfg.train.eval_iters, cfg.logging.log_interval = 7, 3, 5  # safe: resumes
    assert checkpoint_to_resume(cfg) == run_dir / "checkpoints" / "iter_0000003"
    cfg.train.global_batch_size, cfg.train.steps, cfg.model.hidden_size, cfg.train.seed = 16, 4, 32, 7
    message = _resume_error(cfg)
    for change in ("train.global_batch_size: 8 -> 16", "train.steps: 3 -> 4", "model.hidden_size: 64 -> 32",
                   "train.seed: 1234 -> 7"):
        assert change in message, message
    assert "eval" not in message and "log_interval" not in message


def test_resume_from_the_intact_checkpoint_drops_a_torn_metrics_line(finished_run, run, data_dir):
    from mcp_context.pretrain.metrics import read_metrics

    run_dir, _ = run
    (run_dir / "checkpoints" / "iter_0000003" / "__0_0.distcp").write_bytes(b"")
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 4, "loss": 7.9')  # what a crash in the middle of a write leaves
    overrides = ["train.steps=3", "checkpoint.save_interval=1", f"data.cache_dir={data_dir}"]
    refused = _pretrain(run_dir, overrides)
    assert refused.returncode == 2 and "__0_0.distcp is truncated" in refused.stderr, refused.stderr[-2000:]

    resumed = _pretrain(run_dir, overrides, "--resume-from", str(run_dir / "checkpoints" / "iter_0000002"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "dropped the torn last line" in resumed.stdout + resumed.stderr
    records, original = read_metrics(run_dir / "metrics.jsonl"), read_metrics(finished_run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[2]["loss"] == pytest.approx(original[2]["loss"], rel=1e-6)
    assert (run_dir / "checkpoints" / "latest").read_text() == "iter_0000003"


def test_restart_deletes_the_old_checkpoints_and_metrics(run, data_dir):
    from mcp_context.pretrain.metrics import read_metrics

    run_dir, _ = run
    (run_dir / "checkpoints" / "latest").unlink()
    overrides = ["train.steps=2", "checkpoint.save_interval=2", f"data.cache_dir={data_dir}"]
    proc = _pretrain(run_dir, overrides, "--restart")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"removed {run_dir / 'checkpoints' / 'iter_0000003'} (--restart)" in proc.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["iter_0000002", "latest"]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]


def test_non_finite_loss_stops_the_run_before_saving(tmp_path, data_dir):
    from mcp_context.pretrain.metrics import read_metrics

    # lr 1e30: step 1 moves the weights to ~1e30 (finite), step 2's activations overflow.
    proc = _pretrain(tmp_path, ["train.steps=4", "checkpoint.save_interval=1", "optimizer.lr=1e30",
                                f"data.cache_dir={data_dir}"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and error[0].startswith("error: step 2: ") and "optimizer.lr=1e+30" in error[0], error
    assert (tmp_path / "checkpoints" / "latest").read_text() == "iter_0000001"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter_0000001", "latest"]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]


def test_a_corpus_line_that_cannot_be_read_is_one_error_line_naming_file_and_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a first document"}\n{"text": "cut off\n')
    proc = _pretrain(tmp_path / "run", ["train.steps=1", f"data.corpus={corpus}", f"data.cache_dir={tmp_path}"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{corpus}:2" in errors[0], proc.stderr[-2000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_exit_when_torchrun_alone_is_killed(tmp_path, data_dir):
    overrides = [*ONE_RANK, "train.steps=5000", "checkpoint.save_interval=5000", f"data.cache_dir={data_dir}"]
    launcher = subprocess.Popen(_torchrun(1, tmp_path, overrides), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    metrics = tmp_path / "metrics.jsonl"
    while not (metrics.exists() and metrics.stat().st_size) and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = [pid for pid in _process_tree(launcher.pid) if pid != launcher.pid]
    assert launcher.poll() is None and ranks, "the run did not start training"
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    for pid in alive:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not alive, "ranks kept running after torchrun was killed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_fails_before_any_process_group():
    from mcp_context.pretrain.launch import check_recipe_for_training
    from mcp_context.recipes import RecipeConfig, RecipeError

    cfg = RecipeConfig()
    cfg.train.device = "cuda"
    with pytest.raises(RecipeError, match="train.device='cuda'"):
        check_recipe_for_training(cfg, 4)


def test_more_ranks_than_gpus_on_a_node_is_refused_naming_nproc_per_node_and_the_gpu_count(monkeypatch):
    """``train.device=auto`` with 4 ranks launched on a one-GPU node would ask for cuda:1..3: refused,
    naming the launch flag and the GPU count; with a GPU per rank each rank gets its own.
    (CUDA's presence and GPU count are stubbed: what is tested is our check of them.)"""
    from mcp_context.pretrain.build import train_device
    from mcp_context.recipes import RecipeConfig, RecipeError

    cfg = RecipeConfig()
    cfg.train.device = "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RecipeError, match=r"train.device='auto' trains on CUDA, one GPU per rank, but this node "
                                          r"launched 4 rank\(s\) \(torchrun --nproc-per-node\) and has 1 GPU\(s\); "
                                          r"launch with --nproc-per-node 1 or fewer"):
        train_device(cfg)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert train_device(cfg) == torch.device("cuda", 2)


class _Terminal(io.StringIO):
    """An in-memory stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _log_steps(tmp_path, stream, steps: int = 7, interval: int = 3) -> str:
    from mcp_context.pretrain.metrics import MetricsLog, read_metrics

    log = MetricsLog(tmp_path / "metrics.jsonl", 0, steps, enabled=True, progress=True, refresh_interval=interval,
                     stream=stream)
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 5.0 / step, "lr": 1e-3 * step, "grad_norm": 1.0, "tokens_per_s": 2048.0,
                  "step_time_s": 0.25}
        log.log({**record, "val_loss": 4.5} if step == 5 else record)
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, steps + 1))
    return stream.getvalue()


def test_logs_off_a_terminal_are_one_plain_line_per_log_interval_and_no_bar(tmp_path):
    """Under a scheduler stdout is a file: a line every logging.log_interval steps (3, 6) and at the
    evaluation (5), with step, loss, lr, tokens/s and time per step, and no carriage return."""
    text = _log_steps(tmp_path, io.StringIO())
    assert "\r" not in text
    assert text.splitlines() == [
        "step 3/7 | loss 1.6667 | lr 3.00e-03 | 2048 tokens/s | 0.250 s/step",
        "step 5/7 | loss 1.0000 | lr 5.00e-03 | 2048 tokens/s | 0.250 s/step | val_loss 4.5000",
        "step 6/7 | loss 0.8333 | lr 6.00e-03 | 2048 tokens/s | 0.250 s/step",
    ]


def test_logs_on_a_terminal_are_a_progress_bar(tmp_path):
    text = _log_steps(tmp_path, _Terminal())
    assert "\r" in text and "7/7" in text and "step 3/7 |" not in text


def test_a_run_directory_honours_checkpoint_save_null(tmp_path):
    """``--run-dir`` puts checkpoints in RUN_DIR/checkpoints, unless ``checkpoint.save=null`` says to save none:
    the override is honoured, not replaced by the run directory's default."""
    from mcp_context.pretrain.launch import resolve_run_dir
    from mcp_context.recipes import load_recipe

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.yaml"
    saving = load_recipe(recipe)
    assert resolve_run_dir(saving, str(tmp_path)) == tmp_path
    assert saving.checkpoint.save == str(tmp_path / "checkpoints")
    silent = load_recipe(recipe, ["checkpoint.save=null"])
    assert resolve_run_dir(silent, str(tmp_path)) == tmp_path and silent.checkpoint.save is None


def test_overrides_may_come_before_and_after_the_flags(finished_run, data_dir, capsys):
    """``--recipe R a=b --run-dir D c=d``: dotted overrides on either side of a flag are all read (argparse's
    plain parse refused the second group as 'unrecognized arguments'); the launch check sees both, so the
    changed ``train.steps`` after ``--run-dir`` is refused as when it comes last."""
    from mcp_context.pretrain.cli import main

    recipe = ["--check-launch", "1", "--recipe", str(REPO / "recipes" / "tiny_cpu.yaml")]
    rest = ["train.device=cpu", *ONE_RANK, "checkpoint.save_interval=1", f"data.cache_dir={data_dir}"]
    assert main(recipe + rest + ["--run-dir", str(finished_run), "train.steps=3"]) == 0, capsys.readouterr().err
    assert main(recipe + rest + ["--run-dir", str(finished_run), "train.steps=4"]) == 2
    assert "train.steps" in capsys.readouterr().err
