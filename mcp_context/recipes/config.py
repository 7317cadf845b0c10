"""Recipe schema: one dataclass per section, YAML loading, dotted overrides, validation, saving.

A recipe is a YAML file with the sections ``model``, ``data``, ``train``, ``optimizer``,
``checkpoint`` and ``logging`` (NeMo / Megatron-Bridge style). Field names follow megatron-core:
``ModelConfig`` uses ``TransformerConfig`` / ``ModelParallelConfig`` names (plus the few ``GPTModel``
arguments a GPT needs), ``OptimizerConfig`` uses ``megatron.core.optimizer.OptimizerConfig`` names.
The dataclass defaults *are* the tiny CPU recipe (``recipes/tiny_cpu.yaml`` repeats them).

This module owns: the schema and its defaults, type checking of every value read from a file or a
command line, unknown-key errors with a close-match suggestion, the layout checks of a recipe
(run as a pure function, before any process group exists; the context-parallel checks are
``mcp_context.megatron.config.validate_cp_config``, shared with the Megatron integration), and the atomic save of the resolved
config next to checkpoints. It does not build models, process groups or data (see
``mcp_context.data`` and the pretrain entry).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, List, Literal, Mapping, Optional, Sequence, Union

import yaml

from mcp_context.algorithms import COMM_ALIASES
from mcp_context.atomic import write_atomic

RESOLVED_RECIPE_FILENAME = "recipe.yaml"


class RecipeError(ValueError):
    """A recipe that cannot be used: the message names the dotted key, its value and the fix."""


@dataclass
class ModelConfig:
    """The model and its parallel layout, in ``TransformerConfig`` field names."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Width of the residual stream."""
    ffn_hidden_size: Optional[int] = 128
    """Width of the MLP; None means 4 * hidden_size (TransformerConfig's default)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: Optional[int] = 2
    """Key/value heads (grouped-query attention); None means one per query head."""
    kv_channels: Optional[int] = None
    """Head dimension; None means hidden_size // num_attention_heads."""
    seq_length: int = 256
    """Training sequence length in tokens (GPTModel's ``max_sequence_length``); packed samples are
    cut to exactly this many tokens (plus one for the shifted labels)."""
    max_position_embeddings: Optional[int] = None
    """Position table size for learned embeddings; None means seq_length."""
    vocab_size: Optional[int] = None
    """Vocabulary size; None means the tokenizer's, padded to make_vocab_size_divisible_by * TP."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times tensor_model_parallel_size."""
    position_embedding_type: Literal["rope", "learned_absolute", "none"] = "rope"
    """Position encoding (GPTModel argument)."""
    rotary_base: int = 10000
    """RoPE base (500000 for Llama-3)."""
    rotary_percent: float = 1.0
    """Fraction of the head dimension that RoPE rotates."""
    rope_scaling: bool = False
    """Llama-3.1 style RoPE frequency scaling for long context."""
    rope_scaling_factor: float = 8.0
    """Scale factor of rope_scaling."""
    share_embeddings_and_output_weights: bool = False
    """Tie input embedding and output layer (Llama-3: untied)."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Norm layer type."""
    layernorm_epsilon: float = 1e-5
    """Norm epsilon."""
    gated_linear_unit: bool = True
    """Gated MLP (with activation_func=silu this is SwiGLU)."""
    activation_func: Literal["silu", "gelu", "relu", "squared_relu"] = "silu"
    """MLP activation, by name (mapped to the torch function in to_transformer_config_kwargs)."""
    add_bias_linear: bool = False
    """Biases in the linear layers."""
    add_qkv_bias: bool = False
    """Bias in the QKV projection only."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout on the residual branches."""
    init_method_std: float = 0.02
    """Standard deviation of the weight initialisation."""
    tensor_model_parallel_size: int = 1
    """TP degree."""
    pipeline_model_parallel_size: int = 1
    """PP degree."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Interleaved pipeline stages per rank; None for the plain 1F1B schedule."""
    context_parallel_size: int = 4
    """CP degree: the sequence is sharded over this many ranks (zigzag layout)."""
    hierarchical_context_parallel_sizes: Optional[List[int]] = field(default_factory=lambda: [2, 2])
    """CP levels, inner to outer; their product is context_parallel_size. Level 0 (adjacent CP
    ranks, one NVLink domain) runs all-to-all, the outer levels run P2P rings. Only with
    cp_comm_type a2a+p2p."""
    cp_comm_type: str = "a2a+p2p"
    """CP algorithm: p2p (ring), a2a (Ulysses), all_gather (alias allgather), a2a+p2p (hierarchical)."""
    sequence_parallel: bool = False
    """Shard LayerNorm/dropout activations over the TP group (needs TP > 1)."""
    bf16: bool = False
    """bf16 mixed precision."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the parameters (and of pipeline messages)."""
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    """Activation recomputation: None, full or selective."""
    recompute_method: Optional[Literal["uniform", "block"]] = None
    """How full recomputation groups layers."""
    recompute_num_layers: Optional[int] = None
    """Layers per recomputation group (full recomputation)."""
    layer_spec: Literal["local", "te"] = "local"
    """Layer spec of mcp_context.megatron.specs: local (pure PyTorch, any device) or te
    (Transformer Engine linear/norm layers, GPU only)."""


# ModelConfig fields that are GPTModel (or recipe) arguments, not TransformerConfig fields.
_GPT_MODEL_FIELDS = frozenset(
    {
        "seq_length",
        "max_position_embeddings",
        "vocab_size",
        "make_vocab_size_divisible_by",
        "position_embedding_type",
        "rotary_base",
        "rotary_percent",
        "rope_scaling",
        "rope_scaling_factor",
        "share_embeddings_and_output_weights",
        "layer_spec",
    }
)


@dataclass
class DataConfig:
    """Where the tokens come from and how they are tokenised and packed."""

    corpus: str = "bundled"
    """Text to tokenise: ``bundled`` (the shipped Shakespeare scenes), or a path to a .txt file
    (one document) or a .jsonl file (one document per line, text under json_key); .gz allowed."""
    json_key: str = "text"
    """Field holding the text in each JSONL record."""
    data_path: Optional[List[str]] = None
    """Prefixes of already tokenised megatron-core .bin/.idx files; when set, corpus is not read."""
    tokenizer_type: Literal["SentencePieceTokenizer", "HuggingFaceTokenizer"] = "SentencePieceTokenizer"
    """Tokenizer family, in Megatron-LM's ``--tokenizer-type`` spelling."""
    tokenizer_model: Optional[str] = None
    """SentencePiece .model file or Hugging Face tokenizer directory/name. None: the bundled model
    for the bundled corpus, otherwise one trained from the corpus into cache_dir."""
    tokenizer_vocab_size: int = 4096
    """Vocabulary size when a SentencePiece model is trained from the corpus."""
    split: str = "949,50,1"
    """Train/valid/test weights over documents (Megatron's ``--split``)."""
    cache_dir: str = "runs/data"
    """Where tokenised corpora, trained tokenizers and dataset index caches are written."""
    seed: int = 1234
    """Seed of the sample shuffling."""
    num_workers: int = 0
    """DataLoader worker processes."""
    create_attention_mask: bool = False
    """Materialise an [s, s] causal mask per sample; keep False for long context (the CP attention
    applies the causal mask itself)."""
    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""
    reset_attention_mask: bool = False
    """Block attention across documents (needs create_attention_mask)."""
    eod_mask_loss: bool = False
    """Exclude end-of-document tokens from the loss."""


@dataclass
class TrainConfig:
    """Steps, batch sizes and the learning-rate schedule."""

    steps: int = 50
    """Optimizer steps (Megatron's ``--train-iters``)."""
    global_batch_size: int = 8
    """Samples per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 2
    """Samples per forward/backward on one rank."""
    world_size: Optional[int] = 4
    """Ranks this layout is planned for; checked against WORLD_SIZE at launch. None: take the
    launcher's WORLD_SIZE."""
    lr_warmup_iters: int = 5
    """Linear warm-up steps."""
    lr_decay_iters: Optional[int] = None
    """Steps over which the learning rate decays to min_lr; None means steps."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "cosine"
    """Decay shape after warm-up."""
    eval_interval: int = 25
    """Steps between validation runs."""
    eval_iters: int = 2
    """Validation batches per run."""
    seed: int = 1234
    """Seed of the model initialisation and dropout."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where mcp_context.pretrain trains: cpu (gloo), cuda (NCCL, a GPU per rank); auto: cuda when available."""


@dataclass
class OptimizerConfig:
    """Optimizer, in ``megatron.core.optimizer.OptimizerConfig`` field names."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """adam (AdamW with decoupled weight decay) or sgd."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Gradient norm clip."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks."""


@dataclass
class CheckpointConfig:
    """Where checkpoints go; the resolved recipe is saved next to every one."""

    save: Optional[str] = "runs/tiny_cpu/checkpoints"
    """Directory to save checkpoints in; None disables saving."""
    load: Optional[str] = None
    """Directory to resume from; None starts from scratch."""
    save_interval: int = 25
    """Steps between checkpoints."""


@dataclass
class LoggingConfig:
    """What is logged and where."""

    log_interval: int = 1
    """Steps between log lines."""
    tensorboard_dir: Optional[str] = None
    """TensorBoard event directory; None disables TensorBoard."""
    wandb_project: Optional[str] = None
    """Weights & Biases project; None disables it."""


@dataclass
class RecipeConfig:
    """A whole recipe. The defaults are the tiny CPU recipe (4 CP ranks as 2 x 2, world size 4)."""

    name: str = "tiny_cpu"
    """Short name of the recipe."""
    description: str = "Tiny GPT on the bundled corpus: 4 CPU ranks, hierarchical CP [2, 2] (a2a+p2p)."
    """One line on what the recipe is for and the cluster it assumes."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        """Plain nested dict of the recipe (what ``save_recipe`` writes)."""
        return dataclasses.asdict(self)

    def to_transformer_config_kwargs(self) -> dict:
        """Keyword arguments for ``megatron.core.transformer.TransformerConfig``.

        Names map one to one; ``activation_func`` and ``params_dtype`` become the torch objects,
        ``pipeline_dtype`` is set to ``params_dtype`` when PP > 1 (TransformerConfig requires it).
        Runtime-only fields (``use_cpu_initialization``, fusions) are left to the caller.
        """
        import torch
        import torch.nn.functional as F

        kwargs = {
            f.name: getattr(self.model, f.name)
            for f in dataclasses.fields(ModelConfig)
            if f.name not in _GPT_MODEL_FIELDS
        }
        activations = {
            "silu": F.silu,
            "gelu": F.gelu,
            "relu": F.relu,
            "squared_relu": lambda x: torch.pow(F.relu(x), 2),
        }
        kwargs["activation_func"] = activations[self.model.activation_func]
        kwargs["cp_comm_type"] = COMM_ALIASES.get(kwargs["cp_comm_type"], kwargs["cp_comm_type"])  # TE spelling
        kwargs["params_dtype"] = getattr(torch, self.model.params_dtype)
        if self.model.hierarchical_context_parallel_sizes is not None:
            kwargs["hierarchical_context_parallel_sizes"] = list(self.model.hierarchical_context_parallel_sizes)
        if self.model.pipeline_model_parallel_size > 1:
            kwargs["pipeline_dtype"] = kwargs["params_dtype"]
        return kwargs

    def padded_vocab_size(self, tokenizer_vocab_size: int) -> int:
        """``model.vocab_size`` if set, else the tokenizer's size rounded up to a multiple of
        ``make_vocab_size_divisible_by * tensor_model_parallel_size`` (Megatron-LM's rule)."""
        if self.model.vocab_size is not None:
            return self.model.vocab_size
        multiple = self.model.make_vocab_size_divisible_by * self.model.tensor_model_parallel_size
        return int(math.ceil(tokenizer_vocab_size / multiple) * multiple)

    def to_gpt_model_kwargs(self, tokenizer_vocab_size: int) -> dict:
        """Keyword arguments for ``megatron.core.models.gpt.GPTModel`` besides config and spec."""
        m = self.model
        return {
            "vocab_size": self.padded_vocab_size(tokenizer_vocab_size),
            "max_sequence_length": m.max_position_embeddings or m.seq_length,
            "position_embedding_type": m.position_embedding_type,
            "rotary_base": m.rotary_base,
            "rotary_percent": m.rotary_percent,
            "rope_scaling": m.rope_scaling,
            "rope_scaling_factor": m.rope_scaling_factor,
            "share_embeddings_and_output_weights": m.share_embeddings_and_output_weights,
        }

    def to_optimizer_config_kwargs(self) -> dict:
        """Keyword arguments for ``megatron.core.optimizer.OptimizerConfig``."""
        kwargs = dataclasses.asdict(self.optimizer)
        kwargs["bf16"] = self.model.bf16
        kwargs["params_dtype"] = self.to_transformer_config_kwargs()["params_dtype"]
        return kwargs


# ---------------------------------------------------------------------------------------------
# Reading values into the dataclasses, with type checks
# ---------------------------------------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (list, List):
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Return ``value`` checked against ``annotation``; raise RecipeError naming ``key``."""
    origin = typing.get_origin(annotation)
    if origin is Union:
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except RecipeError as err:
                errors.append(err)
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise RecipeError(f"{key}={value!r} is not allowed: use one of {', '.join(map(repr, choices))}{hint}")
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{key}={value!r} must be a {_type_name(annotation)}, e.g. [2, 4]")
        (item_type,) = typing.get_args(annotation)
        return [_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"no reader for the annotation {annotation!r} of {key}")
    raise RecipeError(
        f"{key}={value!r} has type {type(value).__name__}, but {key} must be {_type_name(annotation)}"
    )


def _unknown_key_error(key: str, prefix: str, known: Iterable[str]) -> RecipeError:
    dotted = f"{prefix}{key}"
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return RecipeError(f"unknown recipe key {dotted!r}{hint}")


def _set_field(obj: Any, path: Sequence[str], value: Any, prefix: str = "") -> None:
    """Set the dotted ``path`` below dataclass ``obj`` to ``value``, type-checked."""
    hints = typing.get_type_hints(type(obj))
    key = path[0]
    if key not in hints:
        raise _unknown_key_error(key, prefix, hints)
    annotation = hints[key]
    dotted = f"{prefix}{key}"
    if dataclasses.is_dataclass(annotation):
        section = getattr(obj, key)
        if len(path) > 1:
            _set_field(section, path[1:], value, dotted + ".")
            return
        if value is None:  # a section whose keys are all commented out
            return
        if not isinstance(value, Mapping):
            raise RecipeError(f"{dotted} is a section: give it a mapping of keys, not {value!r}")
        for sub_key, sub_value in value.items():
            _set_field(section, [str(sub_key)], sub_value, dotted + ".")
        return
    if len(path) > 1:
        raise RecipeError(f"{dotted} is a value, not a section: '{dotted}.{'.'.join(path[1:])}' does not exist")
    setattr(obj, key, _coerce(value, annotation, dotted))


class _RecipeYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one
    silently, so a recipe could say ``steps: 10`` and train ``steps: 1000`` further down)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in first_line:
                raise RecipeError(
                    f"recipe {key_node.start_mark.name}: key {key!r} at line {line} repeats the key at line "
                    f"{first_line[key]} of the same section; keep one of them"
                )
            if isinstance(key, typing.Hashable):
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Union[str, os.PathLike]) -> Any:
    """The YAML document of a recipe file (duplicate keys refused, naming the file and lines)."""
    loader = _RecipeYamlLoader(Path(path).read_text(encoding="utf-8"))
    loader.name = str(path)  # marks (and so our messages) name the file
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"model.context_parallel_size=8"`` into (["model", "context_parallel_size"], 8).

    The value is read as YAML, so ``[2, 4]``, ``true``, ``null`` and numbers keep their types.
    """
    if "=" not in text:
        raise RecipeError(f"override {text!r} must look like section.key=value, e.g. train.steps=100")
    dotted, raw = text.split("=", 1)
    path = [p for p in dotted.strip().split(".")]
    if not all(path):
        raise RecipeError(f"override {text!r} has an empty key; write section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise RecipeError(f"override {text!r}: the value is not valid YAML ({err})") from None
    return path, value


def load_recipe(path: Union[str, os.PathLike, None] = None, overrides: Sequence[str] = ()) -> RecipeConfig:
    """Read a recipe: defaults (the tiny CPU recipe), then the YAML file, then dotted overrides.

    Every key is type-checked; unknown keys at any depth raise ``RecipeError`` with a suggestion.
    The result is not yet validated as a layout: call ``validate_recipe`` (the CLI and the pretrain
    entry do).
    """
    cfg = RecipeConfig()
    if path is not None:
        try:
            data = _read_yaml(path) or {}
        except yaml.YAMLError as err:
            raise RecipeError(f"recipe {path} is not valid YAML: {err}") from None
        if not isinstance(data, Mapping):
            raise RecipeError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
        for key, value in data.items():
            _set_field(cfg, [str(key)], value)
    for text in overrides:
        keys, value = parse_override(text)
        _set_field(cfg, keys, value)
    return cfg


def save_recipe(cfg: RecipeConfig, directory: Union[str, os.PathLike]) -> Path:
    """Write the resolved recipe as ``directory/recipe.yaml`` (temporary name, then rename)."""
    text = "# Resolved recipe (file + overrides), saved by mcp_context.recipes\n" + yaml.safe_dump(
        cfg.to_dict(), sort_keys=False, default_flow_style=None
    )
    return write_atomic(Path(directory) / RESOLVED_RECIPE_FILENAME, text.encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# Layout validation (pure: no process group, no file system)
# ---------------------------------------------------------------------------------------------


def _resolve_world_size(cfg: RecipeConfig, world_size: Optional[int]) -> Optional[int]:
    """The launcher's world size (argument, else WORLD_SIZE), which must match train.world_size
    when the recipe plans one; else the planned one; else None."""
    env = os.environ.get("WORLD_SIZE")
    launched = world_size if world_size is not None else (int(env) if env else None)
    planned = cfg.train.world_size
    if launched is not None and planned is not None and launched != planned:
        raise RecipeError(
            f"train.world_size={planned} but the launch has {launched} ranks; set train.world_size={launched} "
            f"(and check the batch sizes) or launch {planned} ranks"
        )
    return launched if launched is not None else planned


def validate_recipe(cfg: RecipeConfig, world_size: Optional[int] = None) -> None:
    """Check that the recipe describes a runnable job; raise ``RecipeError`` naming the key.

    Runs every recipe check: a plain ``name``, each numeric field inside its ``RANGES`` entry, the
    layout, batch, schedule and data checks, and checkpoint/log directories that are not files.
    ``world_size`` (else the WORLD_SIZE variable, else ``train.world_size``) enables the
    data-parallel checks; a launch size that differs from ``train.world_size`` is an error. No
    process group, and no file access beyond a stat of the output directories: safe to call first.
    """
    m = cfg.model
    _validate_name(cfg.name)
    _validate_ranges(cfg)

    # The CP checks shared with the Megatron integration: one check, one message. Imported here
    # because mcp_context.megatron imports megatron-core (seconds), which loading a recipe does not need.
    from mcp_context.megatron.config import HCPConfigError, validate_cp_config

    try:
        validate_cp_config(m, seq_length=m.seq_length, prefix="model.")
    except HCPConfigError as err:
        raise RecipeError(str(err)) from err
    _validate_tensor_parallel_kv_heads(m)
    if m.num_layers % m.pipeline_model_parallel_size:
        raise RecipeError(
            f"model.num_layers={m.num_layers} is not divisible by "
            f"model.pipeline_model_parallel_size={m.pipeline_model_parallel_size}; choose a PP size "
            f"that divides the layer count"
        )
    if m.virtual_pipeline_model_parallel_size is not None:
        stages = m.pipeline_model_parallel_size * m.virtual_pipeline_model_parallel_size
        if m.pipeline_model_parallel_size < 2 or m.num_layers % stages:
            raise RecipeError(
                f"model.virtual_pipeline_model_parallel_size={m.virtual_pipeline_model_parallel_size} "
                f"needs model.pipeline_model_parallel_size > 1 and num_layers={m.num_layers} divisible by "
                f"pipeline * virtual stages = {stages}; set it to null or change the layout"
            )
    if m.position_embedding_type == "learned_absolute" and (m.max_position_embeddings or m.seq_length) < m.seq_length:
        raise RecipeError(
            f"model.max_position_embeddings={m.max_position_embeddings} is smaller than "
            f"model.seq_length={m.seq_length}; raise it to at least {m.seq_length}"
        )
    _validate_batch(cfg, _resolve_world_size(cfg, world_size))
    _validate_schedule(cfg)
    _validate_data(cfg.data)
    _validate_paths(cfg)


def _validate_tensor_parallel_kv_heads(m: ModelConfig) -> None:
    groups = m.num_query_groups or m.num_attention_heads
    if groups % m.tensor_model_parallel_size:
        raise RecipeError(
            f"model.num_query_groups={groups} is not divisible by "
            f"model.tensor_model_parallel_size={m.tensor_model_parallel_size}; choose a TP size that divides "
            f"the number of key/value heads"
        )


def _validate_batch(cfg: RecipeConfig, world_size: Optional[int]) -> None:
    m, t = cfg.model, cfg.train
    if t.global_batch_size % t.micro_batch_size:
        raise RecipeError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size}"
        )
    if world_size is None:
        return
    model_ranks = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    if world_size % model_ranks:
        raise RecipeError(
            f"world size {world_size} (train.world_size or WORLD_SIZE) is not divisible by "
            f"tensor * pipeline * context parallel sizes = {model_ranks}; launch a multiple of {model_ranks} ranks"
        )
    dp = world_size // model_ranks
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise RecipeError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size * data-parallel size = {t.micro_batch_size} * {dp}; "
            f"use a multiple of {t.micro_batch_size * dp}"
        )


def _validate_schedule(cfg: RecipeConfig) -> None:
    t, o = cfg.train, cfg.optimizer
    decay = t.lr_decay_iters if t.lr_decay_iters is not None else t.steps
    if not 0 <= t.lr_warmup_iters <= decay:
        raise RecipeError(
            f"train.lr_warmup_iters={t.lr_warmup_iters} must be between 0 and the decay length "
            f"(train.lr_decay_iters or train.steps = {decay})"
        )
    if t.lr_decay_style == "WSD":
        raise RecipeError(
            "train.lr_decay_style='WSD' needs a WSD decay length, which recipes have no field for; "
            "use 'cosine', 'linear', 'inverse-square-root' or 'constant'"
        )
    if not 0 <= o.min_lr <= o.lr:
        raise RecipeError(f"optimizer.min_lr={o.min_lr} must be between 0 and optimizer.lr={o.lr}")


def _validate_data(d: DataConfig) -> None:
    split_weights(d.split)
    if d.tokenizer_type == "HuggingFaceTokenizer" and d.tokenizer_model is None:
        raise RecipeError(
            "data.tokenizer_type='HuggingFaceTokenizer' needs data.tokenizer_model (a tokenizer directory)"
        )
    if d.reset_attention_mask:
        raise RecipeError(
            "data.reset_attention_mask=true asks for per-document attention masks, which the HCP core attention "
            "does not apply yet (under a causal mask type it ignores attention_mask, as TEDotProductAttention "
            "does, so documents would silently attend across boundaries); set it to false"
        )


def split_weights(split: str) -> list[float]:
    """The train, valid, test weights of a ``data.split`` string (Megatron's ``--split``), padded
    with zeros to three; raise ``RecipeError`` unless they are up to three finite non-negative
    numbers with a positive sum."""
    try:
        weights = [float(p) for p in split.split(",")]
    except ValueError:
        weights = []
    if (not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights)
            or sum(weights) <= 0):
        raise RecipeError(
            f"data.split={split!r} must be up to three non-negative train,valid,test weights (finite numbers "
            f"with a positive sum), e.g. '949,50,1'"
        )
    return weights + [0.0] * (3 - len(weights))


_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _validate_name(name: str) -> None:
    """``runs/<name>`` is derived from the name, so it must stay one plain directory name."""
    if not _PLAIN_NAME.fullmatch(name) or ".." in name:
        plain = re.sub(r"[^A-Za-z0-9._-]+", "_", name).replace("..", "_").strip("._-") or "my_recipe"
        raise RecipeError(
            f"name={name!r} must be a plain name (letters, digits, '.', '_', '-'; no path separator, no '..'), "
            f"since the run directory runs/<name> is derived from it; e.g. name: {plain}"
        )


@dataclass(frozen=True)
class Range:
    """The values a numeric recipe field may take: ``lo``/``hi`` bounds (None: unbounded), each
    closed unless marked open. Floats must also be finite; ``why`` explains a bound that is not obvious."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def describe(self, key: str, integer: bool) -> str:
        """What the field must be, e.g. ``a finite number with 0 <= optimizer.adam_beta1 < 1``."""
        if integer and self.hi is None and self.lo in (0, 1) and not self.lo_open:
            what = "a positive integer" if self.lo == 1 else "a non-negative integer"
        else:
            lo = "" if self.lo is None else f"{_number(self.lo)} {'<' if self.lo_open else '<='} "
            hi = "" if self.hi is None else f" {'<' if self.hi_open else '<='} {_number(self.hi)}"
            if self.hi is None:
                lo, hi = "", f" {'>' if self.lo_open else '>='} {_number(self.lo)}"
            what = f"{'an integer' if integer else 'a finite number'} with {lo}{key}{hi}"
        return what + (f" ({self.why})" if self.why else "")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


_POSITIVE = Range(1)
_NON_NEGATIVE = Range(0)
_PROBABILITY = Range(0, 1, hi_open=True, why="a dropout probability")
_BETA = Range(0, 1, hi_open=True, why="an exponential-average decay")
_POSITIVE_REAL = Range(0, lo_open=True)
_SEED = Range(0, 2**32 - 1, why="numpy seeds are 32-bit")

RANGES: dict[str, Range] = {
    "model.num_layers": _POSITIVE,
    "model.hidden_size": _POSITIVE,
    "model.ffn_hidden_size": _POSITIVE,
    "model.num_attention_heads": _POSITIVE,
    "model.num_query_groups": _POSITIVE,
    "model.kv_channels": _POSITIVE,
    "model.seq_length": _POSITIVE,
    "model.max_position_embeddings": _POSITIVE,
    "model.vocab_size": _POSITIVE,
    "model.make_vocab_size_divisible_by": _POSITIVE,
    "model.rotary_base": _POSITIVE,
    "model.rotary_percent": Range(0, 1, lo_open=True, why="the fraction of each head that RoPE rotates"),
    "model.rope_scaling_factor": _POSITIVE_REAL,
    "model.layernorm_epsilon": Range(0, 1, lo_open=True, hi_open=True),
    "model.attention_dropout": _PROBABILITY,
    "model.hidden_dropout": _PROBABILITY,
    "model.init_method_std": _POSITIVE_REAL,
    "model.tensor_model_parallel_size": _POSITIVE,
    "model.pipeline_model_parallel_size": _POSITIVE,
    "model.virtual_pipeline_model_parallel_size": _POSITIVE,
    "model.context_parallel_size": _POSITIVE,
    "model.hierarchical_context_parallel_sizes": _POSITIVE,
    "model.recompute_num_layers": _POSITIVE,
    "data.tokenizer_vocab_size": Range(
        262, why="SentencePiece needs the 4 special ids, the newline piece and 256 byte-fallback pieces, plus one"),
    "data.seed": _SEED,
    "data.num_workers": _NON_NEGATIVE,
    "train.steps": Range(1, 10**8, why="10**8 steps is far beyond any run, and a larger count makes the "
                                       "sample index build effectively forever"),
    "train.global_batch_size": _POSITIVE,
    "train.micro_batch_size": _POSITIVE,
    "train.world_size": _POSITIVE,
    "train.lr_warmup_iters": _NON_NEGATIVE,
    "train.lr_decay_iters": _POSITIVE,
    "train.eval_interval": _POSITIVE,
    "train.eval_iters": Range(0, why="0 disables evaluation"),
    "train.seed": _SEED,
    "optimizer.lr": _POSITIVE_REAL,
    "optimizer.min_lr": Range(0),
    "optimizer.weight_decay": Range(0),
    "optimizer.adam_beta1": _BETA,
    "optimizer.adam_beta2": _BETA,
    "optimizer.adam_eps": Range(0, 1, lo_open=True, hi_open=True),
    "optimizer.clip_grad": Range(0, why="0 disables clipping"),
    "checkpoint.save_interval": _POSITIVE,
    "logging.log_interval": _POSITIVE,
}
"""Allowed range of every numeric recipe field (a list field: of each item), by dotted key."""


def _validate_ranges(cfg: RecipeConfig) -> None:
    for dotted, allowed in RANGES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        items = [(dotted, value)] if not isinstance(value, list) else [
            (f"{dotted}[{i}]", v) for i, v in enumerate(value)]
        for name, v in items:
            if v is not None and v not in allowed:
                raise RecipeError(f"{name}={v!r} must be {allowed.describe(name, isinstance(v, int))}")


def _validate_paths(cfg: RecipeConfig) -> None:
    """Directories the run writes or reads must not be files (the only file-system access here:
    a stat of each path and its parents)."""
    for key in ("checkpoint.save", "checkpoint.load", "logging.tensorboard_dir"):
        section, field_name = key.split(".")
        value = getattr(getattr(cfg, section), field_name)
        if value is None:
            continue
        path = Path(value).expanduser()
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            where = "is" if existing == path else f"is inside {existing}, which is"
            raise RecipeError(
                f"{key}={value!r} {where} an existing file, not a directory; give a directory path "
                f"(created when missing), or null"
            )
