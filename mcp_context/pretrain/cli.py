"""Command line of the pretrain entry: check the recipe, then train on every rank.

    torchrun --nproc-per-node 4 -m mcp_context.pretrain --recipe recipes/tiny_cpu.yaml \
        [--run-dir runs/my_run] [--resume-from CHECKPOINT | --restart] [section.key=value ...]
    python -m mcp_context.pretrain --check-launch 4 ...the same arguments...

(also ``tools/pretrain.py`` and the ``mcp-context-pretrain`` console script, each calling ``main``.)

A bad recipe, a launch that does not fit it, or a run directory that cannot be resumed as asked
(a malformed ``latest``, a damaged checkpoint, checkpoints without ``latest``, a recipe that changes
the run, a malformed ``metrics.jsonl``, a corpus line that cannot be read) prints ``error: ...`` naming
the key or file (and line) and the fix, and exits with status 2. A run that diverges (non-finite loss, gradient
norm or weights) prints ``error: ...`` with the step and exits with status 1. At the end rank 0
prints the first and last loss and where the metrics and the checkpoint are. ``--check-launch N``
runs the checks that need no process group (the recipe at N ranks, the run directory's resume) in
one process and exits 0 or 2: ``make train`` runs it before torchrun, whose own report of a rank's
non-zero exit is a traceback of some 45 lines after the one error line. Under torchrun each
rank dies with its launcher (``PR_SET_PDEATHSIG`` on Linux): torchrun starts ranks in sessions of
their own, so killing torchrun alone would otherwise leave them training.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings

# Not news to a user: megatron-core lacking fused kernels on CPU, and deprecations inside megatron-core
# and torch.distributed.checkpoint that only their maintainers can act on.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed")
warnings.filterwarnings("ignore", message="full scope is deprecated")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|megatron)\.")

from mcp_context.megatron_import import import_megatron_core  # noqa: E402
from mcp_context.pretrain.launch import check_recipe_for_training, launched_world_size, resolve_run_dir  # noqa: E402
from mcp_context.recipes import RecipeError, load_recipe  # noqa: E402

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher() -> bool:
    """Under torchrun on Linux, have the kernel SIGKILL this process when its launcher dies; return
    whether it was set. (A run killed at any moment resumes from its last complete checkpoint.)"""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def _error(message: str, status: int) -> int:
    if os.environ.get("RANK", "0") == "0":  # every rank finds the same error; say it once
        print(f"error: {message}", file=sys.stderr)
    return status


def _check_resume(cfg, resume_from: str | None, restart: bool) -> int:
    """The resume ``train`` would do (no process group): 0, or 2 with the error (e.g. a changed train.steps)."""
    from mcp_context.pretrain.checkpoint import CheckpointError, checkpoint_to_resume

    try:
        checkpoint_to_resume(cfg, resume_from, restart)
    except CheckpointError as err:
        return _error(str(err), 2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcp_context.pretrain", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=None, help="recipe YAML (default: the embedded tiny CPU recipe)")
    parser.add_argument("--run-dir", default=None,
                        help="directory for metrics.jsonl, recipe.yaml and checkpoints/ (default: the parent of "
                             "checkpoint.save, e.g. runs/tiny_cpu)")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--resume-from", default=None, metavar="CHECKPOINT",
                       help="resume from this checkpoint directory (RUN_DIR/checkpoints/iter_NNNNNNN) instead of "
                            "the one 'latest' names, e.g. the newest intact one when the latest is damaged")
    start.add_argument("--restart", action="store_true",
                       help="start at step 0, deleting the run directory's checkpoints and metrics.jsonl")
    parser.add_argument("--check-launch", type=int, default=None, metavar="N",
                        help="check the recipe at N ranks and the run directory's resume in this one process, "
                             "then exit (0: the launch would train; 2: the error)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    args = parser.parse_intermixed_args(argv)
    die_with_launcher()
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        run_dir = resolve_run_dir(cfg, args.run_dir)
        check_recipe_for_training(cfg, launched_world_size() if args.check_launch is None else args.check_launch)
    except (RecipeError, FileNotFoundError) as err:
        return _error(str(err), 2)
    if args.check_launch is not None:
        return _check_resume(cfg, args.resume_from, args.restart)

    import_megatron_core()  # before anything of megatron-core: its fusions compile at first call
    from mcp_context.data import CorpusError
    from mcp_context.pretrain.checkpoint import CheckpointError
    from mcp_context.pretrain.loop import TrainingDiverged, train
    from mcp_context.pretrain.metrics import MetricsFileError

    try:
        result = train(cfg, run_dir, progress=True, resume_from=args.resume_from, restart=args.restart)
    except (CheckpointError, MetricsFileError, CorpusError) as err:
        return _error(str(err), 2)
    except TrainingDiverged as err:
        return _error(str(err), 1)
    if os.environ.get("RANK", "0") != "0":
        return 0
    if result.records:
        first, last = result.records[0], result.records[-1]
        print(f"loss {first['loss']:.4f} at step {first['step']} -> {last['loss']:.4f} at step {last['step']}")
        evals = [r for r in result.records if "val_loss" in r]
        if evals:
            print(f"val_loss {evals[0]['val_loss']:.4f} at step {evals[0]['step']} -> "
                  f"{evals[-1]['val_loss']:.4f} at step {evals[-1]['step']}")
    else:
        print(f"nothing to do: the run is already at step {result.first_step} of train.steps={cfg.train.steps}")
    print(f"metrics: {result.metrics_path}")
    print(f"checkpoint: {result.checkpoint if result.checkpoint is not None else 'none (checkpoint.save is null)'}")
    return 0
