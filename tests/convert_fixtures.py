"""Shared pieces of the checkpoint-conversion tests (``tests/test_convert_*.py``).

Small random-weight models are built with ``transformers`` from configs (no downloads): Llama with
GQA and Llama-3 RoPE scaling, Mistral with a sliding window on every layer, Qwen2 with QKV bias and
tied embeddings, and Qwen2 with a sliding window on its upper layers only (``max_window_layers``).
The test files load this module as a pytest plugin (``pytest_plugins``), so the session fixture
``converted`` converts each model once, whichever file asks first.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mcp_context.convert.__main__ import main
from mcp_context.convert.converter import hf_to_mcore, mcore_to_hf

SEQ, BATCH = 24, 2
# fp32 megatron vs fp32 HF on logits of magnitude ~1-10 (measured differences ~1e-6); the bound
LOGIT_ATOL = 1e-4
WINDOW = 8  # the window models' sliding_window: a third of SEQ
_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
               rms_norm_eps=1e-5)
MODELS = {
    "llama_gqa_rope3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=10000.0, sliding_window=WINDOW)),
    "qwen2_bias_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True)),
    # layer 0 attends in full, layers 1 and 2 slide (transformers: layers i >= max_window_layers)
    "qwen2_upper_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        rope_theta=1e6, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
}
WINDOW_MODELS = ("mistral_window", "qwen2_upper_window")
# Issue 21's families, one model each, converted by their own fixture (``converted_families``): Qwen3 with
# its per-head q/k norms and a window on its upper layer, Mixtral (renormalised top-2 of 4 experts) with a
# window on every layer, Qwen3-MoE (top-2 of 4 unnormalised, norm_topk_prob=false) with q/k norms and tied
# embeddings, gpt-oss (learned sinks, biases everywhere, clamped GLU, a window on its first layer). Norms are
# drawn around 1, so a dropped (reset) norm shows in the logits.
# YaRN as released: gpt-oss's is GptOssConfig's default (factor 32, not truncated), DeepSeek-V3's and Qwen3's
# long-context one are those of their published config.json files.
DEEPSEEK_V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
QWEN3_YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        rope_parameters=QWEN3_YARN, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        rope_theta=1e6, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        rope_theta=1e6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False,
        tie_word_embeddings=True)),
    # its default YaRN RoPE, a clamp low enough that O(1) activations reach it
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW, swiglu_limit=1.5)),
    # MLA (q and kv latents, interleaved RoPE dims), sigmoid top-2 of 8 among the best 1 of 2 groups with the
    # expert bias, one shared expert; every layer MoE (dense first layers are refused)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        first_k_dense_replace=0, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        rope_parameters=DEEPSEEK_V3_YARN)),
}


def build_hf_model(name: str) -> torch.nn.Module:
    """The table's model ``name`` (``MODELS`` or ``FAMILIES``) with seeded O(1) weights, in eval mode
    with eager attention."""
    import transformers

    config_cls, _, extra = {**MODELS, **FAMILIES}[name]
    return seeded_hf_model(getattr(transformers, config_cls)(**{**_COMMON, **extra}))


def seeded_hf_model(config) -> torch.nn.Module:
    """transformers' causal LM of ``config`` with seeded O(1) weights (norms around 1, the router's expert bias
    drawn too), in eval mode with eager attention."""
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # O(1) weights so that logits are O(1) and every tensor matters
        for pname, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in pname else 0.15) + (1.0 if "norm" in pname else 0.0))
        for pname, b in model.named_buffers():  # DeepSeek-V3's router bias is a saved buffer
            if pname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model


def tokens(seq: int = SEQ) -> torch.Tensor:
    """``[BATCH, seq]`` seeded token ids."""
    return torch.randint(0, _COMMON["vocab_size"], (BATCH, seq), generator=torch.Generator().manual_seed(7))


def _convert_all(tmp_path_factory, names) -> dict:
    out = {}
    for name in names:
        root = tmp_path_factory.mktemp(name)
        model = build_hf_model(name)
        model.save_pretrained(root / "hf")
        with torch.no_grad():
            reference = model(tokens()).logits.float()
        arch = hf_to_mcore(root / "hf", root / "mcore", progress=False)
        out[name] = (root / "hf", root / "mcore", arch.to_record(), reference)
    return out


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """name -> (hf_dir, mcore_dir, architecture record, HF reference logits [b, s, v] on ``tokens()``)."""
    return _convert_all(tmp_path_factory, MODELS)


@pytest.fixture(scope="session")
def converted_families(tmp_path_factory):
    """The same for the ``FAMILIES`` models."""
    return _convert_all(tmp_path_factory, FAMILIES)


def load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path``, read by the ``safetensors`` package."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def assert_same_tensors(back: dict, original: dict) -> None:
    """Same names, and every tensor equal bit for bit in value and dtype."""
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def assert_converts_back_bit_for_bit(saved_dir, hf_dir, out_dir) -> None:
    """A checkpoint saved from a (TP- or PP-split) model converts back to exactly the original HF tensors."""
    import json

    mcore_to_hf(saved_dir, out_dir, hf_config=json.loads((hf_dir / "config.json").read_text()), progress=False)
    assert_same_tensors(load_safetensors_dir(out_dir), load_safetensors_dir(hf_dir))


def init_megatron(tp: int = 1, cp: int = 1, **kwargs) -> None:
    """megatron-core's parallel state on this gloo rank, seeded, pinned to the CPU (every megatron_patches
    patch applied, the CPU shims also where CUDA is present; the models come from
    ``verify.build_gpt_model``, whose device defaults to the CPU)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import megatron_patches

    megatron_patches.apply_all(device="cpu")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp, **kwargs)
    model_parallel_cuda_manual_seed(0)


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Logits are vocab-sharded over TP (parallel_output=True); gather them along the last dim."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def cli_error(capsys, *argv: str) -> str:
    """Run the convert CLI; assert exit status 2 and exactly one ``error:`` line on stderr; return that line."""
    status = main(list(argv))
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err
