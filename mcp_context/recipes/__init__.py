"""NeMo-style training recipes: typed YAML configs, dotted overrides, validation, Megatron-LM flags.

``load_recipe(path, overrides)`` reads a recipe; ``validate_recipe(cfg)`` checks its layout before any
process group starts; ``save_recipe(cfg, dir)`` writes the resolved recipe next to a checkpoint;
``to_megatron_args(cfg)`` gives the equivalent ``pretrain_gpt.py`` flags. CLI:
``python -m mcp_context.recipes {show,validate,to-megatron-args} FILE [key=value ...]``.
"""
from mcp_context.recipes.config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    RecipeConfig,
    RecipeError,
    TrainConfig,
    load_recipe,
    save_recipe,
    validate_recipe,
)
from mcp_context.recipes.megatron_args import format_megatron_command, to_megatron_args

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RecipeConfig",
    "RecipeError",
    "TrainConfig",
    "format_megatron_command",
    "load_recipe",
    "save_recipe",
    "to_megatron_args",
    "validate_recipe",
]
