"""Before anything starts: check a recipe against the launch and the training loop; place the run.

Owns the checks that must fail before any process group exists (the recipe's own layout checks are
``validate_recipe``; here come the launcher's world size and what this training loop supports) and
the run directory layout: ``RUN_DIR/metrics.jsonl``, ``RUN_DIR/recipe.yaml``,
``RUN_DIR/checkpoints/iter_NNNNNNN``. Pure: no process group, no files written.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from mcp_context.recipes import RecipeConfig, RecipeError, validate_recipe

CHECKPOINTS_SUBDIR = "checkpoints"
METRICS_FILENAME = "metrics.jsonl"


def launched_world_size() -> int:
    """The number of ranks the launcher started (torchrun's ``WORLD_SIZE``; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_run_dir(cfg: RecipeConfig, run_dir: Optional[str]) -> Path:
    """The run directory; sets ``cfg.checkpoint.save`` to match it.

    ``run_dir`` given: checkpoints go to ``run_dir/checkpoints``, or nowhere when ``checkpoint.save`` is
    null (the recipe's or an override's: null disables saving, with or without a run directory).
    Otherwise the recipe decides: the parent of ``checkpoint.save`` (``runs/tiny_cpu`` for the tiny
    recipe), or ``runs/<name>`` without checkpoints when ``checkpoint.save`` is null.
    """
    if run_dir is not None:
        if cfg.checkpoint.save is not None:
            cfg.checkpoint.save = str(Path(run_dir) / CHECKPOINTS_SUBDIR)
        return Path(run_dir)
    if cfg.checkpoint.save is not None:
        return Path(cfg.checkpoint.save).parent
    return Path("runs") / cfg.name


def check_recipe_for_training(cfg: RecipeConfig, world_size: int) -> None:
    """Raise ``RecipeError`` naming the key for a recipe this launch cannot train.

    Checks that the recipe's ``train.world_size`` equals the launch, runs ``validate_recipe`` at the
    launched world size, then checks what the loop needs: one pipeline stage, a
    ``checkpoint.load`` that holds a checkpoint, and, on the CPU (``train.device``), fp32 parameters, the plain (not
    distributed) optimizer and no step graphs.
    """
    t, m, o = cfg.train, cfg.model, cfg.optimizer
    if t.world_size is not None and t.world_size != world_size:
        raise RecipeError(
            f"train.world_size={t.world_size} but {world_size} rank(s) were launched; run "
            f"`torchrun --nproc-per-node {t.world_size} -m mcp_context.pretrain ...`, or set "
            f"train.world_size={world_size} (and a layout that fits it)"
        )
    validate_recipe(cfg, world_size=world_size)  # every recipe check, the intervals' ranges included
    if m.pipeline_model_parallel_size != 1:
        raise RecipeError(
            f"model.pipeline_model_parallel_size={m.pipeline_model_parallel_size}: mcp_context.pretrain runs "
            f"one pipeline stage; set it to 1, or train with Megatron-LM "
            f"(python -m mcp_context.megatron_lm RECIPE prints the command)"
        )
    if cfg.logging.tensorboard_dir is not None or cfg.logging.wandb_project is not None:
        raise RecipeError(
            "logging.tensorboard_dir / logging.wandb_project are not written by mcp_context.pretrain "
            "(every step goes to RUN_DIR/metrics.jsonl); set them to null"
        )
    if cfg.checkpoint.load is not None:
        from mcp_context.pretrain.checkpoint import LATEST_FILENAME

        if not (Path(cfg.checkpoint.load) / LATEST_FILENAME).is_file():
            raise RecipeError(
                f"checkpoint.load={cfg.checkpoint.load!r} holds no '{LATEST_FILENAME}' file naming a checkpoint; "
                f"give the checkpoints directory of a run (RUN_DIR/checkpoints), or null to start afresh"
            )
    if cfg.checkpoint.pretrained is not None:
        from mcp_context.pretrain.checkpoint import checkpoint_problem

        problem = checkpoint_problem(cfg.checkpoint.pretrained, training=False)
        if problem is not None:
            raise RecipeError(f"checkpoint.pretrained={cfg.checkpoint.pretrained!r}: {problem}; give a megatron-core "
                              f"checkpoint directory of this model (e.g. python -m mcp_context.convert hf-to-mcore's "
                              f"--mcore), or null")
    if m.params_dtype == "float16":
        raise RecipeError(
            "model.params_dtype='float16' (fp16 mixed precision, Megatron-LM's --fp16): mcp_context.pretrain has no "
            "loss scaling, which fp16 needs; use model.bf16=true model.params_dtype=bfloat16, or train fp16 with "
            "Megatron-LM (python -m mcp_context.megatron_lm RECIPE prints the command)")
    from mcp_context.pretrain.build import train_device

    if train_device(cfg).type == "cpu":  # train.device=cuda without CUDA raises here
        if m.bf16 or m.params_dtype != "float32":
            raise RecipeError(
                f"model.bf16={m.bf16}, model.params_dtype={m.params_dtype!r}: on the CPU (train.device) "
                f"mcp_context.pretrain trains in fp32 (megatron-core's mixed-precision optimizer needs CUDA); "
                f"set model.bf16=false model.params_dtype=float32"
            )
        if o.use_distributed_optimizer:
            raise RecipeError(
                "optimizer.use_distributed_optimizer=true needs CUDA (megatron-core's distributed optimizer "
                "allocates its buffers on the GPU); set it to false on CPU"
            )
        if m.cp_step_graphs:
            raise RecipeError("model.cp_step_graphs=true replays the attention step from CUDA graphs, and this run "
                              "trains on the CPU (train.device); set model.cp_step_graphs=false")
