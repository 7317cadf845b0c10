"""Recipe -> Megatron-LM ``pretrain_gpt.py`` command line, for users of Megatron-LM itself.

Owns the mapping from recipe fields to Megatron-LM argument names (``megatron/training/arguments.py``
spelling) and the printing of a ``torchrun ... pretrain_gpt.py`` command that runs as printed. The
layer spec is ours: ``--spec mcp_context.megatron.specs hcp_local_spec`` (or ``hcp_te_spec``, or the
local variant for MoE / q/k norms / MLA, ``spec_name``), and
the CP flags use Transformer Engine's spelling (``all_gather``, not ``allgather``).

It sits above both ``mcp_context.recipes`` and ``mcp_context.data`` (it needs the data prefixes and
document counts), so it is a top-level module next to the entry points rather than part of either:
recipes <- data <- megatron_lm, no arrow back.
"""
from __future__ import annotations

import shlex
from typing import Optional

from mcp_context.cp_rules import canonical_comm, dynamic_cp_sizes
from mcp_context.data.corpus import (BUNDLED_CORPUS, corpus_path, data_prefixes, read_documents, empty_test_split,
                                     tokenizer_model_path)
from mcp_context.recipes import RecipeConfig, RecipeError
from mcp_context.recipes.schema import check_vocab_size, layer_spec_kwargs, precision

SPEC_MODULE = "mcp_context.megatron.specs"
SPEC_NAMES = {"local": "hcp_local_spec", "te": "hcp_te_spec"}
"""The spec of a dense, plain-attention recipe per ``model.layer_spec``; ``spec_name`` picks the local
variant of a recipe with MoE, q/k norms or MLA."""
_TRANSFORMER_IMPL = {"local": "local", "te": "transformer_engine"}
TOKENIZER_TYPES = {"SentencePieceTokenizer": "GPTSentencePieceTokenizer", "HuggingFaceTokenizer": "HuggingFaceTokenizer"}
"""``data.tokenizer_type`` -> Megatron-LM's ``--tokenizer-type`` of the same tokenizer. Our SentencePiece
tokenizer is Megatron-LM's ``GPTSentencePieceTokenizer`` (the model's pieces, end of document = EOS);
its ``SentencePieceTokenizer`` adds <CLS>, <SEP>, <EOD> and <MASK> ids, a larger embedding and an
end-of-document id our tokenised data never holds."""

OUR_ENTRY_ONLY = {
    "name": "the recipe's label (first comment line)",
    "description": "the recipe's label (first comment line)",
    "data.corpus": "the text the prepare step tokenises into the --data-path files",
    "data.json_key": "read by the prepare step; Megatron-LM reads the tokenised --data-path files",
    "data.tokenizer_vocab_size": "the size of the SentencePiece model the prepare step trains (--tokenizer-model)",
    "train.world_size": "the launcher's rank count (torchrun's nproc-per-node times nnodes, printed there)",
    "train.device": "Megatron-LM trains on CUDA only",
    "checkpoint.pretrained": "Megatron-LM's --pretrained-checkpoint looks for its own latest_checkpointed_iteration.txt "
                             "tracker, which a conversion does not write, and without it starts from random weights",
}
"""Recipe fields with no ``pretrain_gpt.py`` flag, and why; printed in the command's comment block.
Every other field is printed as the flag that means the same thing, or refused where no flag does
(``tests/test_recipes_megatron_lm.py`` walks the schema)."""

REFUSED_UNLESS_DEFAULT = {
    "model.original_max_position_embeddings": "Megatron-LM 0.16.1 has no flag for MLA's YaRN "
                                              "original_max_position_embeddings (MLATransformerConfig's 4096 applies)",
    "model.beta_fast": "Megatron-LM 0.16.1 has no flag for MLA's YaRN beta_fast (MLATransformerConfig's 32 applies)",
    "model.beta_slow": "Megatron-LM 0.16.1 has no flag for MLA's YaRN beta_slow (MLATransformerConfig's 1 applies)",
    "model.cp_step_graphs": "--spec takes a module-level spec, and none of mcp_context.megatron.specs replays the "
                            "attention step from CUDA graphs (get_gpt_layer_hcp_spec(step_graphs=True) does, in a script)",
}
"""Recipe fields Megatron-LM can only take at their default: another value is a ``RecipeError``
(``tests/test_recipes_megatron_lm.py`` walks these too)."""

LOCAL_IMPL_FLAGS = ("--no-rope-fusion", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion")
"""Megatron-LM turns these fusions on by default and they need Transformer Engine (RoPE) or apex
(layer norm, weight-gradient accumulation); a ``local`` recipe promises neither, so its command
turns them off (they are optional kernels: the numbers are the same)."""


def _activation_flags(cfg: RecipeConfig) -> list[str]:
    m = cfg.model
    flags = {
        (True, "silu"): ["--swiglu"],
        (False, "gelu"): [],
        (False, "squared_relu"): ["--squared-relu"],
        (True, "quick_gelu"): ["--quick-geglu"],
    }
    key = (m.gated_linear_unit, m.activation_func)
    if key not in flags:
        raise RecipeError(
            f"model.gated_linear_unit={m.gated_linear_unit} with model.activation_func={m.activation_func!r} "
            f"has no Megatron-LM flag; use gated silu (--swiglu), gated quick_gelu (--quick-geglu), plain gelu or "
            f"plain squared_relu"
        )
    return flags[key]


PER_LAYER_NOTE = ("model.moe_layer_freq={freq}: dense layers among MoE ones need one layer spec per layer, and "
                  "Megatron-LM's --spec imports one module-level object (not called with the config), so it cannot "
                  "carry them; printed without --spec: Megatron-LM builds the block itself (get_gpt_decoder_block_spec "
                  "with --moe-layer-freq), with Transformer Engine's attention running CP, not the HCP attention "
                  "(our entry builds it with get_gpt_decoder_block_hcp_spec)")


def spec_name(cfg: RecipeConfig) -> Optional[str]:
    """The module-level spec of ``mcp_context.megatron.specs`` that builds the recipe's layers
    (``--spec MODULE NAME`` takes an object, not a call): the local variant for its MoE / q/k norm /
    MLA structure, ``hcp_te_spec`` for a dense plain-attention TE recipe; None (print no --spec) for
    dense layers among MoE ones, which no object built before the config can hold (``PER_LAYER_NOTE``).
    A structure no module-level spec builds is a ``RecipeError``."""
    from mcp_context.megatron.spec_facts import SPEC_VARIANTS, LayerSpecFacts

    m = cfg.model
    if m.num_moe_experts is not None and m.moe_layer_freq != 1:
        if m.layer_spec == "local" and m.context_parallel_size > 1:
            raise RecipeError(
                f"model.moe_layer_freq={m.moe_layer_freq!r} with model.layer_spec='local' and "
                f"model.context_parallel_size={m.context_parallel_size}: Megatron-LM's --spec cannot carry one layer "
                f"spec per layer, and without it Megatron-LM's local attention refuses CP > 1; set model.layer_spec=te "
                f"(Transformer Engine's attention then runs CP), or train it with our entry (python -m "
                f"mcp_context.pretrain)")
        return None
    layer_spec_kwargs(m)
    wanted = LayerSpecFacts(qk_layernorm=m.qk_layernorm, moe=m.num_moe_experts is not None,
                            multi_latent_attention=m.multi_latent_attention)
    if m.layer_spec == "te":
        if wanted.structure() != LayerSpecFacts().structure():
            raise RecipeError(f"model.layer_spec='te' with {_structure_words(m)}: {SPEC_NAMES['te']} builds dense "
                              f"plain-attention layers without q/k norms; use model.layer_spec=local")
        return SPEC_NAMES["te"]
    for name, facts in SPEC_VARIANTS.items():
        if facts.structure() == wanted.structure():
            return name
    raise RecipeError(f"{_structure_words(m)}: no module-level layer spec of {SPEC_MODULE} builds it for --spec "
                      f"(MLA's specs have the latent norms: set model.qk_layernorm=true)")


def _structure_words(m) -> str:
    words = [f"model.{k}={v!r}" for k, v in (("multi_latent_attention", m.multi_latent_attention),
                                              ("num_moe_experts", m.num_moe_experts), ("qk_layernorm", m.qk_layernorm))]
    return ", ".join(words)


def _check_megatron_lm_defaults(cfg: RecipeConfig) -> None:
    """``REFUSED_UNLESS_DEFAULT``: a value Megatron-LM's flags cannot give is an error naming the key."""
    from mcp_context.recipes import ModelConfig

    defaults = ModelConfig()
    for key, why in REFUSED_UNLESS_DEFAULT.items():
        name = key.split(".", 1)[1]
        value = getattr(cfg.model, name)
        if value != getattr(defaults, name):
            raise RecipeError(f"{key}={value!r} has no Megatron-LM spelling: {why}; train it with our entry "
                              f"(python -m mcp_context.pretrain) or use the default {getattr(defaults, name)!r}")


def _attention_flags(cfg: RecipeConfig) -> list[str]:
    """Sinks, q/k norms and MLA, as Megatron-LM's flags (TransformerConfig's and its MLA group's)."""
    m, args = cfg.model, []
    if m.softmax_type != "vanilla":
        args += ["--softmax-type", m.softmax_type]
    if m.qk_layernorm:
        args.append("--qk-layernorm")
    if not m.multi_latent_attention:
        return args
    args.append("--multi-latent-attention")
    if m.q_lora_rank is not None:  # Megatron-LM's default is None (no query compression)
        args += ["--q-lora-rank", str(m.q_lora_rank)]
    args += ["--kv-lora-rank", str(m.kv_lora_rank), "--qk-head-dim", str(m.qk_head_dim),
             "--qk-pos-emb-head-dim", str(m.qk_pos_emb_head_dim), "--v-head-dim", str(m.v_head_dim),
             "--rope-type", m.rope_type]
    if m.rope_type == "yarn":
        args += ["--rotary-scaling-factor", str(m.rotary_scaling_factor), "--mscale", str(m.mscale),
                 "--mscale-all-dim", str(m.mscale_all_dim)]
    return args


YARN_FLAGS_SINCE = "Megatron-LM after core_v0.16.1 (its --position-embedding-type has no yarn)"
"""Where the non-MLA YaRN flags exist: Megatron-LM's ``_apply_yarn_config_from_args`` (main, 2026) maps them
to the ``yarn_*`` config attributes; core_v0.16.1's parser refuses ``--position-embedding-type yarn``."""


def _yarn_flags(m) -> list[str]:
    """A non-MLA model's YaRN, as Megatron-LM's flags (the unprefixed three are the ones MLA's YaRN uses)."""
    args = ["--rotary-scaling-factor", str(m.yarn_rotary_scaling_factor),
            "--yarn-original-max-position-embeddings", str(m.yarn_original_max_position_embeddings),
            "--yarn-beta-fast", str(m.yarn_beta_fast), "--yarn-beta-slow", str(m.yarn_beta_slow),
            "--mscale", str(m.yarn_mscale), "--mscale-all-dim", str(m.yarn_mscale_all_dim)]
    args.append("--yarn-correction-range-round-to-int" if m.yarn_correction_range_round_to_int
                else "--no-yarn-correction-range-round-to-int")
    return args


def _layer_pattern(freq) -> str:
    """A per-layer pattern flag's value: an int, or the list expression Megatron-LM evaluates (no spaces)."""
    return str(freq) if isinstance(freq, int) else "[" + ",".join(str(v) for v in freq) + "]"


def _mlp_flags(cfg: RecipeConfig) -> list[str]:
    """The GLU's offset and clamp and the MoE fields, as Megatron-LM's flags."""
    m, args = cfg.model, []
    if m.glu_linear_offset != 0.0:
        args += ["--glu-linear-offset", str(m.glu_linear_offset)]
    if m.activation_func_clamp_value is not None:
        args += ["--activation-func-clamp-value", str(m.activation_func_clamp_value)]
    if m.num_moe_experts is None:
        return args
    args += ["--num-experts", str(m.num_moe_experts), "--moe-router-topk", str(m.moe_router_topk),
             "--moe-layer-freq", _layer_pattern(m.moe_layer_freq),
             "--moe-router-score-function", m.moe_router_score_function,
             "--moe-router-load-balancing-type", m.moe_router_load_balancing_type,
             "--moe-aux-loss-coeff", str(m.moe_aux_loss_coeff)]
    optional = (("--moe-ffn-hidden-size", m.moe_ffn_hidden_size),
                ("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size),
                ("--moe-router-topk-scaling-factor", m.moe_router_topk_scaling_factor),
                ("--moe-router-num-groups", m.moe_router_num_groups),
                ("--moe-router-group-topk", m.moe_router_group_topk))
    args += [x for flag, value in optional if value is not None for x in (flag, str(value))]
    if m.moe_router_pre_softmax:
        args.append("--moe-router-pre-softmax")
    if m.moe_router_enable_expert_bias:
        args.append("--moe-router-enable-expert-bias")
    return args


def _hybrid_cp_flags(cfg: RecipeConfig) -> list[str]:
    """megatron-core's hybrid CP for ``model.hybrid_context_parallel``. The flag names are from Megatron-LM's
    ``arguments.py`` (which also asserts ``--calculate-per-token-loss`` with them); no Megatron-LM run here used
    them. Refused where Megatron-LM cannot give what our entry trains: its scheduler gives a document a power of
    two of ranks (ours any divisor the hierarchy can cut), and it asserts that the hierarchy multiplies to
    ``--context-parallel-size``, 1 under hybrid CP, so a hierarchy over the data parallel group has no flag."""
    m = cfg.model
    if not m.hybrid_context_parallel:
        return []
    if m.hierarchical_context_parallel_sizes is not None:
        raise RecipeError(
            f"model.hierarchical_context_parallel_sizes={m.hierarchical_context_parallel_sizes} with "
            f"model.hybrid_context_parallel=true has no Megatron-LM spelling: Megatron-LM asserts that "
            f"--hierarchical-context-parallel-sizes multiplies to --context-parallel-size, which hybrid CP needs at 1; "
            f"set it to null with a flat model.cp_comm_type (p2p, a2a or all_gather), or train with our entry")
    if cfg.train.world_size is None:
        raise RecipeError("model.hybrid_context_parallel=true with train.world_size=null: the printed command cannot "
                          "check that Megatron-LM's power-of-two groups cut the data parallel group; set "
                          "train.world_size")
    dp = cfg.train.world_size // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size)
    sizes = dynamic_cp_sizes(dp, dp)
    if any(size & (size - 1) for size in sizes):
        raise RecipeError(
            f"model.hybrid_context_parallel=true over {dp} data parallel ranks has no Megatron-LM spelling: our entry "
            f"gives documents groups of {sizes} ranks, Megatron-LM's scheduler only powers of two; launch a "
            f"power-of-two number of data parallel ranks, or train with our entry")
    return ["--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank", str(m.max_seqlen_per_dp_cp_rank),
            "--calculate-per-token-loss"]


def to_megatron_args(cfg: RecipeConfig) -> list[str]:
    """The ``pretrain_gpt.py`` arguments equivalent to ``cfg`` (a flat argv list)."""
    m, d, t, o, c, log = cfg.model, cfg.data, cfg.train, cfg.optimizer, cfg.checkpoint, cfg.logging
    args: list[str] = []

    def add(flag: str, *values: object) -> None:
        args.append(flag)
        args.extend(str(v) for v in values)

    # Model shape.
    add("--num-layers", m.num_layers)
    add("--hidden-size", m.hidden_size)
    # always: Megatron-LM's default with --swiglu is 2/3 of TransformerConfig's 4 * hidden_size
    add("--ffn-hidden-size", m.ffn_hidden_size if m.ffn_hidden_size is not None else 4 * m.hidden_size)
    add("--num-attention-heads", m.num_attention_heads)
    _check_megatron_lm_defaults(cfg)
    spec = spec_name(cfg)
    if m.num_query_groups is not None and m.num_query_groups != m.num_attention_heads:
        add("--group-query-attention")
        add("--num-query-groups", m.num_query_groups)
    if m.kv_channels is not None:
        add("--kv-channels", m.kv_channels)
    add("--seq-length", m.seq_length)
    add("--max-position-embeddings", m.max_position_embeddings or m.seq_length)
    add("--position-embedding-type", m.position_embedding_type)
    if m.position_embedding_type in ("rope", "yarn"):
        if not float(m.rotary_base).is_integer():
            raise RecipeError(f"model.rotary_base={m.rotary_base} has no Megatron-LM spelling (--rotary-base takes "
                              f"an integer); use a whole number")
        add("--rotary-base", int(m.rotary_base))
        add("--rotary-percent", m.rotary_percent)
        if m.rope_scaling:
            add("--use-rope-scaling")
            add("--rope-scaling-factor", m.rope_scaling_factor)
        if m.position_embedding_type == "yarn":
            args.extend(_yarn_flags(m))
    add("--normalization", m.normalization)
    add("--norm-epsilon", m.layernorm_epsilon)
    args.extend(_activation_flags(cfg))
    args.extend(_mlp_flags(cfg))
    args.extend(_attention_flags(cfg))
    if not m.add_bias_linear:
        add("--disable-bias-linear")
    if m.add_qkv_bias:
        add("--add-qkv-bias")
    if m.window_size is not None:
        add("--window-size", ",".join(str(w) for w in m.window_size))
    if isinstance(m.window_attn_skip_freq, int):
        add("--window-attn-skip-freq", m.window_attn_skip_freq)
    elif m.window_attn_skip_freq is not None:
        add("--window-attn-skip-freq", _layer_pattern(m.window_attn_skip_freq))
    if not m.share_embeddings_and_output_weights:
        add("--untie-embeddings-and-output-weights")
    add("--attention-dropout", m.attention_dropout)
    add("--hidden-dropout", m.hidden_dropout)
    add("--init-method-std", m.init_method_std)
    add("--make-vocab-size-divisible-by", vocab_multiple(cfg))

    # Parallel layout and our layer spec.
    add("--tensor-model-parallel-size", m.tensor_model_parallel_size)
    add("--pipeline-model-parallel-size", m.pipeline_model_parallel_size)
    if m.virtual_pipeline_model_parallel_size is not None:
        add("--num-virtual-stages-per-pipeline-rank", m.virtual_pipeline_model_parallel_size)
    add("--context-parallel-size", m.context_parallel_size)
    add("--cp-comm-type", canonical_comm(m.cp_comm_type))
    if m.hierarchical_context_parallel_sizes is not None:
        add("--hierarchical-context-parallel-sizes", *m.hierarchical_context_parallel_sizes)
    args.extend(_hybrid_cp_flags(cfg))
    if m.sequence_parallel:
        add("--sequence-parallel")
    add("--transformer-impl", _TRANSFORMER_IMPL[m.layer_spec])
    if spec is not None:
        add("--spec", SPEC_MODULE, spec)
    if m.layer_spec == "local":
        args.extend(LOCAL_IMPL_FLAGS)
    args.extend({"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}[precision(m)])
    if m.recompute_granularity is not None:
        add("--recompute-granularity", m.recompute_granularity)
    if m.recompute_method is not None:
        add("--recompute-method", m.recompute_method)
    if m.recompute_num_layers is not None:
        add("--recompute-num-layers", m.recompute_num_layers)

    # Data.
    add("--data-path", *data_prefixes(d))
    add("--split", megatron_split(cfg)[0])
    add("--tokenizer-type", TOKENIZER_TYPES[d.tokenizer_type])
    add("--tokenizer-model", tokenizer_model_path(d))
    add("--data-cache-path", d.cache_dir)
    add("--num-workers", d.num_workers)
    if not d.create_attention_mask:
        add("--no-create-attention-mask-in-dataloader")
    for flag in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        if getattr(d, flag):
            add("--" + flag.replace("_", "-"))

    # Training and schedule.
    add("--micro-batch-size", t.micro_batch_size)
    add("--global-batch-size", t.global_batch_size)
    add("--train-iters", t.steps)
    add("--lr-warmup-iters", t.lr_warmup_iters)
    add("--lr-decay-iters", t.lr_decay_iters if t.lr_decay_iters is not None else t.steps)
    add("--lr-decay-style", t.lr_decay_style)
    add("--eval-interval", t.eval_interval)
    add("--eval-iters", t.eval_iters)
    add("--seed", t.seed)  # Megatron-LM's one seed: model init, dropout and data order (data.seed too when equal)

    # Optimizer.
    add("--optimizer", o.optimizer)
    add("--lr", o.lr)
    add("--min-lr", o.min_lr)
    add("--weight-decay", o.weight_decay)
    add("--adam-beta1", o.adam_beta1)
    add("--adam-beta2", o.adam_beta2)
    add("--adam-eps", o.adam_eps)
    add("--clip-grad", o.clip_grad)
    if o.use_distributed_optimizer:
        add("--use-distributed-optimizer")

    # Checkpoints and logging.
    if c.save is not None:
        add("--save", c.save)
        add("--save-interval", c.save_interval)
    if c.load is not None:
        add("--load", c.load)
    add("--log-interval", log.log_interval)
    if log.tensorboard_dir is not None:
        add("--tensorboard-dir", log.tensorboard_dir)
    if log.wandb_project is not None:
        add("--wandb-project", log.wandb_project)
    return args


def vocab_multiple(cfg: RecipeConfig) -> int:
    """``--make-vocab-size-divisible-by``: the recipe's, or, with ``model.vocab_size`` V set (our entry's
    embedding then has exactly V rows), V / TP, so that Megatron-LM pads its tokenizer's vocabulary
    (at most V, which the prepare step checks) to exactly V rows too."""
    m = cfg.model
    if m.vocab_size is None:
        return m.make_vocab_size_divisible_by
    check_vocab_size(m)
    return m.vocab_size // m.tensor_model_parallel_size


def comment_notes(cfg: RecipeConfig) -> list[str]:
    """The comment block's notes on fields printed other than as themselves, and the fields with no flag."""
    m, notes = cfg.model, []
    if m.vocab_size is not None:
        notes.append(f"model.vocab_size={m.vocab_size}: printed as --make-vocab-size-divisible-by {vocab_multiple(cfg)} "
                     f"(x TP {m.tensor_model_parallel_size}), so Megatron-LM pads the tokenizer's vocabulary to "
                     f"{m.vocab_size} rows, as our entry does")
    if cfg.data.seed != cfg.train.seed:
        notes.append(f"data.seed={cfg.data.seed}: our entry only: Megatron-LM orders the data with --seed "
                     f"{cfg.train.seed}, so the printed run sees its samples in another order")
    if m.num_moe_experts is not None and m.moe_layer_freq != 1:
        notes.append(PER_LAYER_NOTE.format(freq=_layer_pattern(m.moe_layer_freq)))
    if m.position_embedding_type == "yarn":
        notes.append(f"model.position_embedding_type=yarn: the --yarn-* flags need {YARN_FLAGS_SINCE}")
    notes += [f"{key}: our entry only: {why}" for key, why in OUR_ENTRY_ONLY.items()]
    return notes


def _document_counts(cfg: RecipeConfig) -> Optional[dict[str, int]]:
    """Documents per data prefix, where they can be known here: from tokenised files that exist, or
    by reading the bundled corpus (236 scenes); None for data not tokenised yet or not on this machine."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    counts = {}
    for prefix in data_prefixes(cfg.data):
        if IndexedDataset.exists(prefix):
            counts[prefix] = len(IndexedDataset(prefix).sequence_lengths)
        elif not cfg.data.data_path and corpus_path(cfg.data) == BUNDLED_CORPUS:
            counts[prefix] = sum(1 for _ in read_documents(BUNDLED_CORPUS, cfg.data.json_key))
        else:
            return None
    return counts


def megatron_split(cfg: RecipeConfig) -> tuple[str, Optional[str]]:
    """The ``--split`` to print and a note on any change. Megatron-LM's dataset builder loops forever
    on a split of positive weight that holds no document (megatron-core 0.16), so: an empty train or
    valid split is a ``RecipeError``; an empty test split gets weight 0 (Megatron-LM then builds no
    test set), with a note saying so. Unknown document counts leave the split as it is."""
    split = cfg.data.split
    counts = _document_counts(cfg)
    if counts is None:
        return split, None
    weights = [w.strip() for w in split.split(",")]
    weights += ["0"] * (3 - len(weights))
    empty_test = [f"{prefix} ({n_docs} documents)" for prefix, n_docs in counts.items()
                  if empty_test_split(split, prefix, n_docs)]
    if not empty_test:
        return split, None
    adjusted = ",".join(weights[:2] + ["0"])
    return adjusted, (f"data.split={split!r} leaves the test split of {', '.join(empty_test)} empty, which "
                      f"Megatron-LM's dataset builder loops on forever; printed --split {adjusted} (no test set)")


def _launcher(world_size: Optional[int]) -> str:
    if world_size is None:
        return "torchrun --nproc-per-node $GPUS_PER_NODE --nnodes $NNODES"
    if world_size > 8 and world_size % 8 == 0:
        return f"torchrun --nproc-per-node 8 --nnodes {world_size // 8}"
    return f"torchrun --nproc-per-node {world_size}"


def format_megatron_command(cfg: RecipeConfig, prepare_hint: Optional[str] = None) -> str:
    """A shell command running Megatron-LM's ``pretrain_gpt.py`` with the recipe's flags, one flag
    per line. ``prepare_hint`` (e.g. the command that tokenises the corpus) is printed as a comment."""
    comments = [f"# Recipe {cfg.name}: {cfg.description}"]
    if prepare_hint and not cfg.data.data_path:
        comments.append(f"# Tokenise the corpus first: {prepare_hint}")
    split_note = megatron_split(cfg)[1]
    if split_note:
        comments.append(f"# {split_note}")
    if cfg.model.layer_spec == "local":
        comments.append(f"# layer_spec local: {' '.join(LOCAL_IMPL_FLAGS)} (those fusions need Transformer Engine or apex)")
    argv = to_megatron_args(cfg)
    comments += [f"# {note}" for note in comment_notes(cfg)]
    command = [f"{_launcher(cfg.train.world_size)} pretrain_gpt.py"]
    starts = [i for i, a in enumerate(argv) if a.startswith("--")] + [len(argv)]
    for a, b in zip(starts, starts[1:]):
        command.append("    " + " ".join(shlex.quote(x) for x in argv[a:b]))
    return "\n".join(comments) + "\n" + " \\\n".join(command)
