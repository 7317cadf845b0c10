"""The audit of every ``TransformerConfig`` / ``MLATransformerConfig`` field, as a test.

Each field is in exactly one of:
- ``HONOURED``: a parity case here sets it (megatron-core's own local attention at CP=1 against our
  spec at CP=4 as [2, 2], p2p and a2a+p2p: every token's loss and every gradient within 1e-5, fp32),
  or the named test checks it;
- ``REFUSED``: building a model with the value raises ``HCPConfigError`` with the message checked;
- ``NO_EFFECT``: fields that cannot change what the core attention computes, each with its reason.
A field added by a future megatron-core fails ``test_every_config_field_has_a_verdict`` until someone
decides. The parity cases run in one distributed call (parallel state initialised once per world).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from megatron.core.transformer.enums import AttnBackend

from tests._dist import run_distributed
from tests.tiny_gpt import ParityCase, parity_cases

TESTS = Path(__file__).resolve().parent

# ---- honoured: the parity cases (config fields, layer-spec arguments) ----
A2A_P2P = ("a2a+p2p",)  # both levels (heads scattered over 2, a ring of 2); baseline also runs flat p2p
CASES = {case.name: dataclasses.replace(case, comms=case.comms if case.name == "baseline" else A2A_P2P)
         for case in [
    ParityCase("baseline", comms=("p2p", "a2a+p2p")),  # GQA 4/2, RoPE, RMSNorm, SwiGLU
    ParityCase("mqa-head-dim", (("num_query_groups", 1), ("kv_channels", 12))),
    ParityCase("softmax-scale", (("softmax_scale", 0.05),)),
    ParityCase("qk-layer-scaling", (("apply_query_key_layer_scaling", True),)),
    ParityCase("sinks", (("softmax_type", "learnable"),)),
    ParityCase("window", (("window_size", (3, 0)), ("window_attn_skip_freq", 2))),
    ParityCase("qk-layernorm", (("qk_layernorm", True),), (("qk_layernorm", True),)),
    ParityCase("qk-l2-norm", (("qk_l2_norm", True),), (("qk_l2_norm", True),)),
    ParityCase("output-gate", (("attention_output_gate", True),)),
    ParityCase("no-rope-layer", (("no_rope_freq", [0, 1]),)),
    ParityCase("rope-interleaved", (("rotary_interleaved", True),)),
    ParityCase("recompute-core-attn", (("recompute_granularity", "selective"), ("recompute_modules", ["core_attn"]))),
    ParityCase("backend-unfused", (("attention_backend", AttnBackend.unfused),)),
    # megatron-core's local experts in every layer, top-2 of 4 with a softmax router (no aux loss, no
    # capacity: a token's route does not depend on the others); megatron_patches runs the router without TE
    ParityCase("moe", (("num_moe_experts", 4), ("moe_router_topk", 2), ("moe_layer_freq", 1)),
               (("num_experts", 4),)),
]}
GPT_TESTS = "tests/test_megatron_gpt.py"
HONOURED = {
    "context_parallel_size": "baseline", "hierarchical_context_parallel_sizes": "baseline", "cp_comm_type": "baseline",
    "hidden_size": "baseline", "num_layers": "baseline", "num_attention_heads": "baseline",
    "num_query_groups": "mqa-head-dim", "kv_channels": "mqa-head-dim",
    "softmax_scale": "softmax-scale", "apply_query_key_layer_scaling": "qk-layer-scaling",
    "softmax_type": "sinks", "window_size": "window", "window_attn_skip_freq": "window",
    "qk_layernorm": "qk-layernorm", "qk_l2_norm": "qk-l2-norm",
    "attention_output_gate": "output-gate", "no_rope_freq": "no-rope-layer", "rotary_interleaved": "rope-interleaved",
    "recompute_granularity": "recompute-core-attn", "recompute_modules": "recompute-core-attn",
    "attention_backend": "backend-unfused",
    # checked by other tests
    "tensor_model_parallel_size": f"{GPT_TESTS}::test_gpt_with_hcp_spec_matches_cp1_losses_and_gradients",
    "sequence_parallel": f"{GPT_TESTS}::test_gpt_with_hcp_spec_matches_cp1_losses_and_gradients",
    "attention_dropout": "tests/test_dropout.py::test_dropout_gradients_are_the_derivative_of_the_seeded_output",
    "deterministic_mode": f"{GPT_TESTS}::test_deterministic_mode_gives_bitwise_equal_gradients_at_cp4",
    "multi_latent_attention": f"{GPT_TESTS}::test_mla_model_at_cp2_and_cp4_equals_cp1",
    **{f: f"{GPT_TESTS}::test_mla_model_at_cp2_and_cp4_equals_cp1" for f in (
        "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
        "rotary_base", "rotary_percent", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
        "beta_slow", "mscale", "mscale_all_dim")},
    **{f: "tests/test_dynamic_cp.py::test_megatron_hybrid_cp_schedule_matches_cp1_losses_and_gradients"
       for f in ("hybrid_context_parallel", "max_seqlen_per_dp_cp_rank")},
    # the learnable softmax_offset is made from these as megatron-core makes it
    **{f: f"{GPT_TESTS}::test_softmax_offset_is_made_like_megatron_cores" for f in (
        "params_dtype", "init_method", "perform_initialization", "use_cpu_initialization")},
    # a layer spec builds one MLP kind in every layer: the getter's argument (a spec that differs refuses,
    # tests/test_megatron_specs.py::test_fixed_specs_refuse_configs_they_do_not_build)
    "num_moe_experts": "moe", "moe_layer_freq": "moe",
    "moe_grouped_gemm": "tests/test_megatron_specs.py::test_fixed_specs_refuse_configs_they_do_not_build",
}

# ---- refused: (value, extra config, the message) ----
_NO_MAX_LOGIT = r"needs each head's maximum attention logit .* which the context-parallel engine does not compute"
_GRAPH = r"captures the layer in a CUDA graph; .* has not been captured or run in a graph"
REFUSED = {
    "qk_clip": (True, {}, rf"qk_clip=True: {_NO_MAX_LOGIT}; set qk_clip=False"),
    "log_max_attention_logit": (True, {}, rf"log_max_attention_logit=True: {_NO_MAX_LOGIT}"),
    "fp8_dot_product_attention": (True, {}, r"fp8_dot_product_attention=True: our kernels take bf16/fp16/fp32"),
    "fp8_multi_head_attention": (True, {}, r"fp8_multi_head_attention=True: our kernels take bf16/fp16/fp32"),
    "experimental_attention_variant": ("gated_delta_net", {"linear_attention_freq": 1},
                                       r"experimental_attention_variant='gated_delta_net': replaces softmax attention"),
    "flash_decode": (True, {}, r"flash_decode=True: decodes with flash-attn's kernel, bypassing the core attention"),
    "batch_invariant_mode": (True, {"attention_backend": AttnBackend.flash},
                             r"batch_invariant_mode=True: asks for batch-invariant kernels"),
    "use_kitchen": (True, {}, r"use_kitchen=True: builds kitchen's quantised modules"),
    "use_kitchen_attention": (True, {}, r"use_kitchen_attention=True: replaces the core attention with kitchen's"),
    # megatron-core's own check (its RNG tracker) refuses the graph fields first without TE's tracker
    "enable_cuda_graph": (True, {}, rf"enable_cuda_graph=True: {_GRAPH}|RNG tracker does not support cudagraphs"),
    "external_cuda_graph": (True, {}, rf"external_cuda_graph=True: {_GRAPH}"),
    "cuda_graph_impl": ("local", {}, rf"cuda_graph_impl='local': {_GRAPH}|RNG tracker does not support cudagraphs"),
}

# ---- cannot change what the core attention computes ----
_GROUPS = {
    "parallel layout of other modules (pipeline, experts, TP overlap): the core attention sees this rank's q/k/v": (
        "pipeline_model_parallel_comm_backend", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_extended_tp", "gradient_accumulation_fusion",
        "async_tensor_model_parallel_allreduce", "tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad",
        "tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_atomic_ag",
        "tp_comm_split_rs", "tp_comm_atomic_rs", "tp_comm_overlap_disable_qkv", "tp_comm_overlap_disable_fc1",
        "tp_comm_bootstrap_backend", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
        "ep_overlap_early_attn_memory_release", "pipeline_dtype", "variable_seq_lengths", "overlap_p2p_comm",
        "batch_p2p_comm", "batch_p2p_sync", "use_ring_exchange_p2p", "deallocate_pipeline_outputs",
        "defer_embedding_wgrad_compute", "wgrad_deferral_limit", "overlap_p2p_comm_warmup_flush",
        "microbatch_group_size_per_vp_stage", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
        "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split", "symmetric_ar_type", "inference_fuse_tp_communication"),
    "training-loop hooks and bookkeeping, outside the model's maths": (
        "timers", "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
        "barrier_with_L1_time", "config_logger_dir", "test_mode", "calculate_per_token_loss",
        "num_microbatches_with_partial_activation_checkpoints"),
    "megatron-core's own modules, which our spec keeps unchanged (linears, norms, MLP, MoE routing, embeddings, "
    "loss, multi-token prediction): they make q/k/v or use the attention's output": (
        "ffn_hidden_size", "hidden_dropout", "fp32_residual_connection", "apply_residual_connection_post_layernorm",
        "layernorm_epsilon", "layernorm_zero_centered_gamma", "add_bias_linear", "add_qkv_bias", "gated_linear_unit",
        "activation_func", "activation_func_fp8_input_store", "glu_linear_offset", "activation_func_clamp_value",
        "normalization", "output_layer_init_method", "init_method_std", "embedding_init_method",
        "embedding_init_method_std", "mrope_section", "bias_activation_fusion", "persist_layer_norm",
        "memory_efficient_layer_norm", "bias_dropout_fusion", "apply_rope_fusion", "use_fused_weighted_squared_relu",
        "fused_single_qkv_rope", "use_te_activation_func", "clone_scatter_output_in_embedding",
        "disable_parameter_transpose_cache", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
        "disable_bf16_reduced_precision_matmul", "mtp_num_layers", "mtp_loss_scaling_factor", "mtp_standalone",
        "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_shared_expert_overlap",
        "moe_ffn_hidden_size", "moe_router_load_balancing_type", "moe_router_topk", "moe_enable_routing_replay",
        "moe_router_topk_limited_devices", "moe_router_padding_for_quantization", "moe_router_padding_for_fp8",
        "moe_router_num_groups", "moe_router_group_topk", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
        "moe_router_score_function", "moe_router_dtype", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
        "moe_router_force_load_balancing", "moe_use_legacy_grouped_gemm", "moe_aux_loss_coeff", "moe_z_loss_coeff",
        "moe_input_jitter_eps", "moe_token_dropping", "moe_token_dispatcher_type", "moe_enable_deepep",
        "moe_flex_dispatcher_backend", "moe_per_layer_logging", "moe_expert_capacity_factor",
        "moe_pad_expert_input_to_capacity", "moe_token_drop_policy", "moe_permute_fusion", "moe_router_fusion",
        "moe_apply_probs_on_input", "moe_latent_size", "moe_deepep_num_sms", "moe_hybridep_num_sms"),
    "precision of other modules and of megatron-core's softmax kernel; our kernels take q/k/v in their dtype and "
    "keep softmax statistics in fp32 (what attention_softmax_in_fp32=True asks; TE's attention does the same)": (
        "fp16", "bf16", "fp8", "fp8_recipe", "fp8_param", "fp8_quantizer_factory", "fp8_margin", "fp8_interval",
        "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad", "tp_only_amax_red", "first_last_layers_bf16",
        "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "fp4", "fp4_recipe", "fp4_param",
        "fp4_quantizer_factory", "quant_recipe", "enable_autocast", "autocast_dtype", "attention_softmax_in_fp32",
        "masked_softmax_fusion"),
    "memory: recomputation and offloading rerun or move the same computation (dropout seeds come from "
    "megatron-core's RNG tracker, which recomputation restores)": (
        "recompute_method", "recompute_num_layers", "distribute_saved_activations", "cpu_offloading",
        "cpu_offloading_num_layers", "_cpu_offloading_context", "cpu_offloading_activations", "cpu_offloading_weights",
        "cpu_offloading_double_buffering", "fine_grained_activation_offloading", "offload_modules",
        "min_offloaded_tensor_size", "moe_layer_recompute", "init_model_with_meta_device"),
    "inference only (decoding, KV caches, inference layers) or Megatron-LM's choice of default spec, which --spec "
    "replaces": (
        "inference_rng_tracker", "inference_sampling_seed", "use_inference_optimized_layers", "mlp_chunks_for_prefill",
        "cache_mla_latents", "transformer_impl", "use_te_rng_tracker"),
    "read only with a refused field (CUDA graphs, qk_clip, experimental variants) or by other layer "
    "types (Mamba, linear attention) that our specs do not build": (
        "cuda_graph_use_single_mempool", "cuda_graph_retain_backward_graph", "cuda_graph_warmup_steps",
        "cuda_graph_scope", "qk_clip_alpha", "qk_clip_threshold", "dsa_indexer_n_heads",
        "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss",
        "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "kitchen_attention_backend", "is_hybrid_model",
        "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "use_mamba_mem_eff_path",
        "heterogeneous_block_specs", "hetereogenous_dist_checkpoint"),
}
NO_EFFECT = {field: reason for reason, fields in _GROUPS.items() for field in fields}


def _all_fields() -> set[str]:
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    return {f.name for cls in (TransformerConfig, MLATransformerConfig) for f in dataclasses.fields(cls)}


def test_every_config_field_has_a_verdict():
    verdicts = [set(HONOURED), set(REFUSED), set(NO_EFFECT)]
    assert not (verdicts[0] & verdicts[1]) and not (verdicts[0] & verdicts[2]) and not (verdicts[1] & verdicts[2])
    missing = _all_fields() - set().union(*verdicts)
    assert not missing, f"TransformerConfig fields with no verdict (honour, refuse or explain): {sorted(missing)}"
    assert not set().union(*verdicts) - _all_fields(), "verdicts for fields megatron-core no longer has"


def test_honoured_fields_name_a_case_or_an_existing_test():
    for field, where in HONOURED.items():
        if "::" not in where:
            assert where in CASES, field
            continue
        path, name = where.split("::")
        assert re.search(rf"^def {name}\(", (TESTS.parent / path).read_text(), re.M), f"{field}: {where} not found"


def test_honoured_fields_match_megatron_core_at_cp1():
    """Every parity case at CP=4 as [2, 2] (p2p and a2a+p2p) against megatron-core's local attention at CP=1."""
    errors = run_distributed(4, parity_cases, list(CASES.values()), [(4, [2, 2])])
    assert not errors[0], "\n".join(errors[0])


def _refusals(rank, world, cases):
    import megatron_patches
    from megatron.core import parallel_state

    from mcp_context.megatron import HCPConfigError
    from mcp_context.megatron.specs import hcp_local_spec
    from tests.tiny_gpt import init_parallel, tiny_config, tiny_gpt

    megatron_patches.apply_all(device="cpu")
    init_parallel()
    messages = {}
    try:
        for field, (value, extra) in cases.items():
            try:
                tiny_gpt(tiny_config(**{field: value}, **extra), hcp_local_spec)
                messages[field] = "built without an error"
            except HCPConfigError as err:
                messages[field] = str(err)
            except Exception as err:  # megatron-core's own check came first: say which
                messages[field] = f"{type(err).__name__}: {err}"
    finally:
        parallel_state.destroy_model_parallel()
    return messages


def test_refused_fields_are_refused_at_model_build_with_the_reason():
    messages = run_distributed(2, _refusals, {f: (v, extra) for f, (v, extra, _) in REFUSED.items()})[0]
    for field, (_, _, pattern) in REFUSED.items():
        assert re.search(pattern, messages[field]), f"{field}: {messages[field]}"
