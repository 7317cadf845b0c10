"""NeMo-style training recipes: typed YAML configs, dotted overrides, validation.

``load_recipe(path, overrides)`` reads a recipe (``reader``); ``validate_recipe(cfg)`` checks that it
is a runnable job before any process group starts (``checks``); ``save_recipe(cfg, dir)`` writes the
resolved recipe next to a checkpoint. The schema, one dataclass per section, is ``schema``. CLI:
``python -m mcp_context.recipes {show,validate} FILE [key=value ...]``; the Megatron-LM translation
and its command are ``mcp_context.megatron_lm`` (it needs ``mcp_context.data``, which builds on this
package).
"""
from mcp_context.recipes.checks import RANGES, validate_recipe
from mcp_context.recipes.reader import RESOLVED_RECIPE_FILENAME, load_recipe, save_recipe
from mcp_context.recipes.schema import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    RecipeConfig,
    RecipeError,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RANGES",
    "RESOLVED_RECIPE_FILENAME",
    "RecipeConfig",
    "RecipeError",
    "TrainConfig",
    "load_recipe",
    "save_recipe",
    "validate_recipe",
]
