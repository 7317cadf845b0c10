"""YaRN RoPE as converted: the frequencies and scales megatron-core computes for a converted gpt-oss, Qwen3
(long-context YaRN) and DeepSeek-V3 (MLA's YaRN) are transformers' own, and the Megatron-LM flags name them.

The logits of the same models match transformers' at CP = 1, 2 and 4 in ``test_convert_families.py``; here the
pieces: the inverse frequencies (fp32, rtol 1e-6), the cos/sin attention factor and, for MLA, the softmax scale
with DeepSeek's ``mscale_all_dim`` (rel 1e-6). Reference: the transformers model's own rotary module and attention.
"""
from __future__ import annotations

import json

import pytest
import torch

from mcp_context.convert.model_config import HFModel

pytest.register_assert_rewrite("tests.convert_fixtures")
from tests._dist import run_distributed
from tests.convert_fixtures import init_megatron

pytest.importorskip("transformers", reason="transformers' YaRN is the reference")
pytest_plugins = ["tests.convert_fixtures"]

YARN_FAMILIES = ("gpt_oss", "qwen3", "deepseek_v3")


def _hf_rope(hf_dir) -> tuple[torch.Tensor, float, float]:
    """(inverse frequencies, cos/sin attention factor, attention softmax scale) of the HF model in ``hf_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    rotary = model.model.rotary_emb
    return rotary.inv_freq.float(), float(rotary.attention_scaling), float(model.model.layers[0].self_attn.scaling)


@pytest.mark.parametrize("name", YARN_FAMILIES)
def test_megatron_yarn_frequencies_and_scales_are_transformers(converted_families, name):
    hf_dir, _, record, _ = converted_families[name]
    rope = json.loads((hf_dir / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "yarn"
    inv_freq, attention_factor, softmax_scale = _hf_rope(hf_dir)
    ours = run_distributed(1, _case_megatron_rope, record)[0]
    torch.testing.assert_close(ours["inv_freq"], inv_freq, rtol=1e-6, atol=0)
    assert ours["attention_factor"] == pytest.approx(attention_factor, rel=1e-6)
    assert ours["softmax_scale"] == pytest.approx(softmax_scale, rel=1e-6)
    plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, inv_freq.numel() * 2, 2).float() / (inv_freq.numel() * 2)))
    assert not torch.allclose(inv_freq, plain, rtol=1e-3)  # YaRN changes the frequencies and the temperature:
    shape = HFModel.from_record(record).shape  # on cos/sin (1.35 for gpt-oss), or in DeepSeek's softmax (1.87x)
    head_dim = shape.qk_head_dim + shape.qk_pos_emb_head_dim if shape.multi_latent_attention else shape.kv_channels
    assert attention_factor ** 2 * softmax_scale * head_dim ** 0.5 > 1.2


def _case_megatron_rope(rank, world_size, record):
    """megatron-core's YaRN of the converted shape: inverse frequencies (the angles at position 1), the factor
    cos/sin are multiplied by, and the attention's softmax scale."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config)

    from mcp_context.convert.verify import build_gpt_model

    init_megatron()
    try:
        shape = HFModel.from_record(record).shape
        gpt = build_gpt_model(shape)
        attention = gpt.decoder.layers[0].self_attention
        if shape.multi_latent_attention:  # MLA's own YaRN: get_emb returns the factor with the angles
            emb, factor = attention.rotary_pos_emb.get_emb(2)
        else:  # GPTModel's YaRN; the attention takes the factor from the config's yarn_* attributes
            emb, _ = gpt.rotary_pos_emb.get_emb(2)
            factor = _yarn_get_concentration_factor_from_config(gpt.config)
        scale = attention.core_attention.softmax_scale  # our core attention: what the kernel multiplies by
        half = emb.shape[-1] // 2
        return {"inv_freq": emb[1, 0, 0, :half].float(), "attention_factor": float(factor),
                "softmax_scale": float(scale)}
    finally:
        parallel_state.destroy_model_parallel()
