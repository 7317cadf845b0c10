"""Pretrain a GPT with hierarchical context parallelism from a recipe, on megatron-core.

    torchrun --nproc-per-node 4 -m mcp_context.pretrain --recipe recipes/tiny_cpu.yaml \
        [--run-dir DIR] [key=value ...]

Modules, one job each: ``cli`` (the command line, ``main``), ``launch`` (checks before any process
group starts; the run directory), ``build`` (process groups, model, optimizer, LR schedule),
``batches`` (which samples each step reads), ``packing`` (documents packed for
``data.reset_attention_mask``), ``loop`` (the training loop), ``checkpoint`` (save /
resume), ``metrics`` (metrics.jsonl and the progress bar). See docs/pretrain.md.
"""
from mcp_context.pretrain.cli import main
from mcp_context.pretrain.launch import check_recipe_for_training, resolve_run_dir
from mcp_context.pretrain.loop import TrainResult, train

__all__ = ["TrainResult", "check_recipe_for_training", "main", "resolve_run_dir", "train"]
