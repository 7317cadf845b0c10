"""Recipe schema: one dataclass per section, with defaults and docstrings, and the one translation
of a model shape into megatron-core's keyword arguments.

A recipe is a YAML file with the sections ``model``, ``data``, ``train``, ``optimizer``,
``checkpoint`` and ``logging`` (NeMo / Megatron-Bridge style). Field names follow megatron-core:
``ModelConfig`` uses ``TransformerConfig`` / ``ModelParallelConfig`` names (plus the few ``GPTModel``
arguments a GPT needs), ``OptimizerConfig`` uses ``megatron.core.optimizer.OptimizerConfig`` names.
The dataclass defaults *are* the tiny CPU recipe (``recipes/tiny_cpu.yaml`` repeats them).

``ModelConfig`` is also *the* model shape of the package: the pretrain entry, the checkpoint
converter (``mcp_context.convert``, which maps a Hugging Face ``config.json`` to and from it) and
the planner (``mcp_context.plan``) all describe a model with it, and ``transformer_config_kwargs`` /
``gpt_model_kwargs`` are the only translation into ``TransformerConfig`` / ``GPTModel``.
Reading a recipe is ``reader``'s job, checking one is ``checks``'s.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, List, Literal, Optional, Union

from mcp_context.cp_rules import canonical_comm


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
    position_embedding_type: Literal["rope", "yarn", "learned_absolute", "none"] = "rope"
    """Position encoding (GPTModel argument); yarn: YaRN-scaled RoPE (gpt-oss, long-context Qwen3) with
    the ``yarn_*`` fields. An MLA model keeps rope: its attention applies RoPE itself (``rope_type``)."""
    rotary_base: Union[int, float] = 10000
    """RoPE base (500000 for Llama-3); a float where a converted model's ``rope_theta`` is one."""
    rotary_percent: float = 1.0
    """Fraction of the head dimension that RoPE rotates."""
    rope_scaling: bool = False
    """Llama-3.1 style RoPE frequency scaling for long context."""
    rope_scaling_factor: float = 8.0
    """Scale factor of rope_scaling."""
    yarn_rotary_scaling_factor: float = 1.0
    """YaRN (position_embedding_type yarn): context extension factor (gpt-oss: 32). The ``yarn_*`` fields
    are the attributes megatron-core's ``GPTModel`` and attention read off the config (Megatron-LM sets
    them from --rotary-scaling-factor, --yarn-*, --mscale, --mscale-all-dim); defaults are Megatron-LM's."""
    yarn_original_max_position_embeddings: int = 4096
    """YaRN: the pre-extension context length."""
    yarn_beta_fast: float = 32.0
    """YaRN: fast correction bound (rotations)."""
    yarn_beta_slow: float = 1.0
    """YaRN: slow correction bound (rotations)."""
    yarn_mscale: float = 1.0
    """YaRN: attention-temperature scale; cos/sin are scaled by mscale(yarn_mscale) / mscale(yarn_mscale_all_dim)."""
    yarn_mscale_all_dim: float = 0.0
    """YaRN: attention-temperature scale over all dims (0: none, the factor's 0.1 ln s + 1 alone)."""
    yarn_correction_range_round_to_int: bool = True
    """YaRN: round the correction range to whole dims (transformers' ``truncate``; gpt-oss: false)."""
    share_embeddings_and_output_weights: bool = False
    """Tie input embedding and output layer (Llama-3: untied)."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Norm layer type."""
    layernorm_epsilon: float = 1e-5
    """Norm epsilon."""
    gated_linear_unit: bool = True
    """Gated MLP (with activation_func=silu this is SwiGLU)."""
    activation_func: Literal["silu", "gelu", "relu", "squared_relu", "quick_gelu"] = "silu"
    """MLP activation, by name (mapped to the torch function in transformer_config_kwargs); quick_gelu
    is megatron-core's ``x * sigmoid(1.702 x)``, gated: gpt-oss's GLU (Megatron-LM's --quick-geglu)."""
    glu_linear_offset: float = 0.0
    """Offset of the GLU's linear half: ``act(x[0]) * (x[1] + offset)`` (gpt-oss: 1.0); gated MLP only."""
    activation_func_clamp_value: Optional[float] = None
    """Clamp of linear_fc1's output in a gated quick_gelu MLP (gpt-oss: 7.0); None: no clamp."""
    add_bias_linear: bool = False
    """Biases in the linear layers."""
    add_qkv_bias: bool = False
    """Bias in the QKV projection only (Qwen2)."""
    window_size: Optional[List[int]] = None
    """Sliding-window attention ``[left, right]`` on every layer: query i sees keys i - left .. i +
    right (-1: unbounded on that side); None: full causal attention. Mistral's ``sliding_window`` w
    is ``[w - 1, 0]``."""
    window_attn_skip_freq: Optional[Union[int, List[int]]] = None
    """Which layers have ``window_size`` (megatron-core's ``is_layer_window_attention``): None: every
    layer; an int n: every layer but each n-th (layers n, 2n, ... attend in full); a list of 0/1, one
    per layer: 1 has the window, 0 attends in full (Qwen2's ``max_window_layers`` is such a list)."""
    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = "vanilla"
    """Attention softmax: vanilla; off-by-one (a zero sink logit per head: ``exp(s) / (1 + sum exp)``);
    learnable (gpt-oss's learned sinks: a ``softmax_offset`` parameter per head)."""
    qk_layernorm: bool = False
    """Norm (``normalization``'s type) on each query and key head (Qwen3, Qwen3-MoE); with MLA, the
    norms of the query and key/value latents (DeepSeek-V3's q_a_layernorm, kv_a_layernorm)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout on the residual branches."""
    init_method_std: float = 0.02
    """Standard deviation of the weight initialisation."""
    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V2/V3, Kimi K2): megatron-core's ``MLATransformerConfig`` with
    the fields below; its query/key head dim is qk_head_dim + qk_pos_emb_head_dim and its value head
    dim v_head_dim. No grouped-query attention (num_query_groups null) and no kv_channels; RoPE is
    applied by the attention itself (rope_type), so position_embedding_type stays rope."""
    q_lora_rank: Optional[int] = 512
    """MLA: rank of the query's low-rank projection; None: a full query projection (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """MLA: rank of the key/value latent."""
    qk_head_dim: int = 128
    """MLA: query/key head dim without position embedding (DeepSeek-V3: 128)."""
    qk_pos_emb_head_dim: int = 64
    """MLA: query/key head dim carrying RoPE (DeepSeek-V3: 64); the attention's q/k head dim is
    qk_head_dim + qk_pos_emb_head_dim."""
    v_head_dim: int = 128
    """MLA: value head dim (DeepSeek-V3: 128, against a q/k head dim of 192)."""
    rope_type: Literal["rope", "yarn"] = "yarn"
    """MLA: RoPE flavour inside the attention: rope (rotary_base, rotary_percent) or yarn (also
    rotary_scaling_factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim)."""
    rotary_scaling_factor: float = 40.0
    """MLA yarn: context extension factor (DeepSeek-V3's rope_scaling.factor)."""
    original_max_position_embeddings: int = 4096
    """MLA yarn: the pre-extension context length."""
    beta_fast: float = 32.0
    """MLA yarn: fast correction bound."""
    beta_slow: float = 1.0
    """MLA yarn: slow correction bound."""
    mscale: float = 1.0
    """MLA yarn: attention-temperature scale."""
    mscale_all_dim: float = 0.0
    """MLA yarn: attention-temperature scale over all dims (DeepSeek-V3: 1.0)."""
    num_moe_experts: Optional[int] = None
    """Routed experts per MoE layer; None: a dense MLP (Megatron-LM's --num-experts)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Width of each routed expert's MLP; None: ffn_hidden_size."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_layer_freq: Union[int, List[int]] = 1
    """Which layers are MoE: an int n: every n-th (layers 0, n, 2n, ...); a list of 0/1, one per layer
    (1: MoE, 0: dense; DeepSeek-V3's dense first layers). Our layer specs put MoE in every layer: 1 only."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Total width of the shared experts (number of shared experts x each one's width); None: none."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router score: softmax (Mixtral, Qwen3-MoE, gpt-oss) or sigmoid (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = False
    """Score all experts before top-k (True) or normalise over the chosen k only (False: Mixtral, gpt-oss)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Scale of the chosen experts' weights (DeepSeek-V3's routed_scaling_factor 2.5); None: 1."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for the choice only (DeepSeek-V3);
    needs the sigmoid score function."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: experts fall into this many equal groups (DeepSeek-V3: 8)."""
    moe_router_group_topk: Optional[int] = None
    """Group-limited routing: groups each token may use (DeepSeek-V3: 4)."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                                            "none"] = "aux_loss"
    """Load-balancing strategy of the router (its loss is weighted by moe_aux_loss_coeff)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss; 0: none."""
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
    hybrid_context_parallel: bool = False
    """Dynamic CP (megatron-core's name): each document of a step runs over the smallest group of the data
    parallel ranks that holds it at max_seqlen_per_dp_cp_rank tokens a rank (docs/dynamic_cp.md). Needs
    context_parallel_size 1 and data.reset_attention_mask; hierarchical_context_parallel_sizes then
    describes the whole data parallel group (level 0: one all-to-all domain)."""
    max_seqlen_per_dp_cp_rank: Optional[int] = None
    """Dynamic CP's per-rank token budget (megatron-core's name): a document of n tokens runs on the
    smallest allowed group of g ranks with g * budget >= n (documents padded to 2 * data parallel size)."""
    sequence_parallel: bool = False
    """Shard LayerNorm/dropout activations over the TP group (needs TP > 1)."""
    bf16: bool = False
    """bf16 mixed precision (bf16 parameters, fp32 main weights in the optimizer): needs
    params_dtype bfloat16. See ``precision``."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the parameters (and of pipeline messages): float32 (fp32 training), bfloat16 (with
    bf16=true) or float16 (fp16 mixed precision, as Megatron-LM's --fp16). See ``precision``."""
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    """Activation recomputation: None, full or selective."""
    recompute_method: Optional[Literal["uniform", "block"]] = None
    """How full recomputation groups layers."""
    recompute_num_layers: Optional[int] = None
    """Layers per recomputation group (full recomputation)."""
    layer_spec: Literal["local", "te"] = "local"
    """Layer spec of mcp_context.megatron.specs: local (pure PyTorch, any device) or te
    (Transformer Engine linear/norm layers, GPU only)."""
    cp_step_graphs: bool = False
    """Replay each rank's attention step from CUDA graphs captured once per shard shape (the spec's
    step_graphs, docs/design.md): for short shards, where the host falls behind the GPU. CUDA, cp_comm_type
    a2a, all_gather or a2a+all_gather (or CP 1), attention_dropout 0, no packed documents. Not yet run on
    a GPU."""


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
        "cp_step_graphs",
    }
)

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
              "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")
"""``MLATransformerConfig`` fields: passed to megatron-core only with ``multi_latent_attention``."""
YARN_FIELDS = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
               "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")
"""YaRN of a non-MLA model: no ``TransformerConfig`` fields but attributes megatron-core reads off the config
(``set_yarn_attributes``), meaningful only with ``position_embedding_type`` yarn."""
MOE_FIELDS = ("moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq", "moe_shared_expert_intermediate_size",
              "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
              "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
              "moe_router_load_balancing_type", "moe_aux_loss_coeff")
"""MoE fields: they mean something only with ``num_moe_experts`` set."""


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
    """Attend within documents only: our pretrain entry packs each micro-batch's documents (ended by the
    end-of-document token) with document masks (thd, ``cu_seqlens``); Megatron-LM applies the flag its
    own way. Keep create_attention_mask false with it."""
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
    pretrained: Optional[str] = None
    """A megatron-core checkpoint of this model (e.g. ``python -m mcp_context.convert hf-to-mcore``'s output)
    whose weights a run with nothing to resume starts from, at step 0 with a fresh optimizer (Megatron-LM's
    --pretrained-checkpoint with --finetune); None: random initialisation."""
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

    def padded_vocab_size(self, tokenizer_vocab_size: int) -> int:
        """``model.vocab_size`` if set, else the tokenizer's size rounded up to a multiple of
        ``make_vocab_size_divisible_by * tensor_model_parallel_size`` (Megatron-LM's rule)."""
        if self.model.vocab_size is not None:
            return self.model.vocab_size
        multiple = self.model.make_vocab_size_divisible_by * self.model.tensor_model_parallel_size
        return int(math.ceil(tokenizer_vocab_size / multiple) * multiple)

    def to_optimizer_config_kwargs(self) -> dict:
        """Keyword arguments for ``megatron.core.optimizer.OptimizerConfig``."""
        kwargs = dataclasses.asdict(self.optimizer)
        kwargs["bf16"] = self.model.bf16
        kwargs["fp16"] = precision(self.model) == "fp16"
        kwargs["params_dtype"] = transformer_config_kwargs(self.model)["params_dtype"]
        return kwargs


_PRECISIONS = {(False, "float32"): "fp32", (True, "bfloat16"): "bf16", (False, "float16"): "fp16"}
_PRECISION_FIXES = {
    (True, "float32"): "bf16 mixed precision keeps bf16 parameters (Megatron-LM's --bf16 makes them so); set "
                       "model.params_dtype=bfloat16, or model.bf16=false for fp32",
    (False, "bfloat16"): "that is bf16 parameters without mixed precision (no fp32 main weights), which "
                         "Megatron-LM has no flag for; set model.bf16=true (bf16 mixed precision, --bf16) or "
                         "model.params_dtype=float32",
    (True, "float16"): "that names two half precisions; set model.params_dtype=bfloat16 (--bf16) or model.bf16=false "
                       "(fp16 mixed precision, --fp16)",
}


def precision(model: ModelConfig) -> Literal["fp32", "bf16", "fp16"]:
    """The training precision ``model.bf16`` and ``model.params_dtype`` name together, as Megatron-LM
    derives it from its flags: fp32 (no flag), bf16 (``--bf16``: bf16 parameters) or fp16 (``--fp16``:
    fp16 parameters, mixed precision). Any other combination is a ``RecipeError``."""
    key = (model.bf16, model.params_dtype)
    if key not in _PRECISIONS:
        raise RecipeError(f"model.bf16={str(model.bf16).lower()} with model.params_dtype={model.params_dtype!r}: "
                          f"{_PRECISION_FIXES[key]}")
    return _PRECISIONS[key]


def check_vocab_size(model: ModelConfig) -> None:
    """A set ``model.vocab_size`` must split evenly over TP (the embedding's rows are split over TP)."""
    if model.vocab_size is not None and model.vocab_size % model.tensor_model_parallel_size:
        raise RecipeError(
            f"model.vocab_size={model.vocab_size} is not divisible by model.tensor_model_parallel_size="
            f"{model.tensor_model_parallel_size} (the embedding is split over TP); round it up to a multiple of "
            f"{model.tensor_model_parallel_size}, or set it to null")


def transformer_config_kwargs(model: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for ``megatron.core.transformer.TransformerConfig`` describing ``model``.

    Names map one to one; ``activation_func`` and ``params_dtype`` become the torch objects, ``fp16``
    is set for fp16 parameters (``precision``; a contradictory precision is a ``RecipeError``),
    ``cp_comm_type`` takes Transformer Engine's spelling, ``window_size`` becomes a tuple (a
    ``window_attn_skip_freq`` or ``moe_layer_freq`` list is copied) and ``pipeline_dtype`` is set to
    ``params_dtype`` when PP > 1 (TransformerConfig requires it). With ``multi_latent_attention`` the
    kwargs are ``MLATransformerConfig``'s (``transformer_config_class``): the MLA fields, and
    ``rotary_base`` / ``rotary_percent``, which MLA's own RoPE reads from the config; without it the
    MLA fields are left out (``TransformerConfig`` has none).
    Runtime-only fields (``use_cpu_initialization``, fusions, loss scaling) are left to the caller.
    """
    import torch
    import torch.nn.functional as F

    skip = _GPT_MODEL_FIELDS | set(YARN_FIELDS) | (set() if model.multi_latent_attention else set(MLA_FIELDS))
    kwargs = {
        f.name: getattr(model, f.name)
        for f in dataclasses.fields(ModelConfig)
        if f.name not in skip
    }
    if model.multi_latent_attention:
        kwargs.update(rotary_base=model.rotary_base, rotary_percent=model.rotary_percent)
    activations = {
        "silu": F.silu,
        "gelu": F.gelu,
        "relu": F.relu,
        "squared_relu": lambda x: torch.pow(F.relu(x), 2),
    }
    if model.activation_func == "quick_gelu":  # megatron-core's MLP picks the clamp/offset GLU by identity
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        activations["quick_gelu"] = quick_gelu
    kwargs["activation_func"] = activations[model.activation_func]
    kwargs["cp_comm_type"] = canonical_comm(kwargs["cp_comm_type"])  # TE spelling
    kwargs["params_dtype"] = getattr(torch, model.params_dtype)
    kwargs["fp16"] = precision(model) == "fp16"  # --fp16's mixed precision, as Megatron-LM builds it
    if model.hierarchical_context_parallel_sizes is not None:
        kwargs["hierarchical_context_parallel_sizes"] = list(model.hierarchical_context_parallel_sizes)
    if model.window_size is not None:
        kwargs["window_size"] = tuple(model.window_size)
    if isinstance(model.window_attn_skip_freq, list):
        kwargs["window_attn_skip_freq"] = list(model.window_attn_skip_freq)
    if isinstance(model.moe_layer_freq, list):
        kwargs["moe_layer_freq"] = list(model.moe_layer_freq)
    if model.pipeline_model_parallel_size > 1:
        kwargs["pipeline_dtype"] = kwargs["params_dtype"]
    return kwargs


def set_yarn_attributes(config: Any, model: ModelConfig) -> Any:
    """``config`` (a ``TransformerConfig`` built from ``transformer_config_kwargs(model)``) with the ``yarn_*``
    attributes megatron-core's ``GPTModel(position_embedding_type='yarn')`` and attention read (no dataclass
    fields: Megatron-LM's argument parsing sets them the same way); unchanged without YaRN."""
    if model.position_embedding_type == "yarn":
        for name in YARN_FIELDS:
            setattr(config, name, getattr(model, name))
    return config


def layer_spec_kwargs(model: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for ``mcp_context.megatron.specs.get_gpt_layer_hcp_spec``: the layer structure
    the model needs (MoE MLP, q/k norms, MLA), its norm and its linear layers. A layer spec puts one
    structure in every layer, so ``moe_layer_freq`` other than 1 (dense layers among MoE ones) is a
    ``RecipeError``: that model takes the block spec (``decoder_spec``)."""
    if model.num_moe_experts is not None and model.moe_layer_freq != 1:
        raise RecipeError(
            f"model.moe_layer_freq={model.moe_layer_freq!r}: a layer spec (get_gpt_layer_hcp_spec) puts the MoE "
            f"MLP in every layer; dense layers among MoE ones take one spec per layer, "
            f"get_gpt_decoder_block_hcp_spec(config) (mcp_context.recipes.schema.decoder_spec)")
    return dict(num_experts=model.num_moe_experts, qk_layernorm=model.qk_layernorm,
                multi_latent_attention=model.multi_latent_attention, normalization=model.normalization,
                use_te=model.layer_spec == "te", step_graphs=model.cp_step_graphs)


def decoder_spec(model: ModelConfig, config: Any) -> Any:
    """The HCP spec ``GPTModel`` takes for ``model`` (``config``: its ``TransformerConfig``): one layer spec,
    ``get_gpt_layer_hcp_spec(**layer_spec_kwargs(model))``, or, with dense layers among MoE ones
    (``moe_layer_freq`` other than 1), the block of per-layer specs ``get_gpt_decoder_block_hcp_spec(config)``."""
    from mcp_context.megatron.specs import get_gpt_decoder_block_hcp_spec, get_gpt_layer_hcp_spec

    if model.num_moe_experts is not None and model.moe_layer_freq != 1:
        return get_gpt_decoder_block_hcp_spec(config, use_te=model.layer_spec == "te",
                                              normalization=model.normalization, step_graphs=model.cp_step_graphs)
    return get_gpt_layer_hcp_spec(**layer_spec_kwargs(model))


def transformer_config_class(model: ModelConfig) -> type:
    """The megatron-core config class ``transformer_config_kwargs(model)`` is for: ``MLATransformerConfig``
    with ``multi_latent_attention`` (as Megatron-LM's ``core_transformer_config_from_args`` picks it),
    else ``TransformerConfig``."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if model.multi_latent_attention else TransformerConfig


def gpt_model_kwargs(model: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """Keyword arguments for ``megatron.core.models.gpt.GPTModel`` besides config and layer spec.

    ``vocab_size`` is the embedding's row count (a recipe's ``padded_vocab_size``, a converted
    model's own ``vocab_size``)."""
    return {
        "vocab_size": vocab_size,
        "max_sequence_length": model.max_position_embeddings or model.seq_length,
        "position_embedding_type": model.position_embedding_type,
        "rotary_base": model.rotary_base,
        "rotary_percent": model.rotary_percent,
        "rope_scaling": model.rope_scaling,
        "rope_scaling_factor": model.rope_scaling_factor,
        "share_embeddings_and_output_weights": model.share_embeddings_and_output_weights,
    }
