"""The released checkpoints' structures, shrunk: per family a tiny model made from the transformers config
class's defaults (the released architecture) with only the sizes changed, every structural field kept: YaRN
(gpt-oss's default; DeepSeek-V3's and Kimi K2's from their published config.json, whose class default is plain),
DeepSeek-V3's three dense first layers, group routing 4 of 8 and MTP layer count, Kimi K2's one dense layer,
gpt-oss's alternating windows and sinks, Qwen3-MoE's ``mlp_only_layers`` variant. Each converts, gives transformers'
logits within 1e-4 (fp32) at CP = 1 and 4 (p2p and a2a+p2p [2, 2]) and converts back bit for bit.

Reference: transformers building the model from its own config class; the safetensors package reading the files.
"""
from __future__ import annotations

import json

import pytest
import torch

from mcp_context.convert.converter import hf_to_mcore, mcore_to_hf

pytest.register_assert_rewrite("tests.convert_fixtures")
from tests._dist import run_distributed
from tests.convert_fixtures import (DEEPSEEK_V3_YARN, LOGIT_ATOL, assert_same_tensors, load_safetensors_dir,
                                    seeded_hf_model)
from tests.test_convert_families import LAYOUTS, SEQ_CP, _case_family_logits, _hf_logits

transformers = pytest.importorskip("transformers", reason="transformers' config classes are the reference")
pytest.importorskip("safetensors", reason="the independent safetensors reader/writer is the reference")

_SMALL = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, max_position_embeddings=4096)
_MLA = dict(_SMALL, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, q_lora_rank=32,
            kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16)
KIMI_K2_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# name -> (config class, sizes only; every other field is the class's default)
RELEASED = {
    "gpt_oss": ("GptOssConfig", dict(_SMALL, intermediate_size=48, head_dim=16, num_key_value_heads=2,
                                     num_hidden_layers=2, num_local_experts=8, sliding_window=8)),
    "deepseek_v3": ("DeepseekV3Config", dict(_MLA, num_hidden_layers=4, rope_parameters=DEEPSEEK_V3_YARN)),
    "kimi_k2": ("DeepseekV3Config", dict(_MLA, num_hidden_layers=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                                         routed_scaling_factor=2.827, num_nextn_predict_layers=0,
                                         rope_parameters=KIMI_K2_YARN)),
    "qwen3": ("Qwen3Config", dict(_SMALL, intermediate_size=96, head_dim=16, num_key_value_heads=2,
                                  num_hidden_layers=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_SMALL, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
                                         num_key_value_heads=2, num_hidden_layers=2, num_experts=16)),
    "qwen3_moe_dense_layer": ("Qwen3MoeConfig", dict(_SMALL, intermediate_size=96, moe_intermediate_size=32,
                                                     head_dim=16, num_key_value_heads=2, num_hidden_layers=3,
                                                     num_experts=16, mlp_only_layers=[1], norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(_SMALL, intermediate_size=96, head_dim=16, num_key_value_heads=2,
                                      num_hidden_layers=2)),
}
# Fields a variant sets beside the sizes on purpose (the published config's, where the class default is not it).
PUBLISHED = {"rope_parameters", "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
             "num_nextn_predict_layers", "mlp_only_layers", "norm_topk_prob"}
SIZE_FIELDS = set(_MLA) | {"head_dim", "num_hidden_layers", "num_local_experts", "num_experts", "sliding_window",
                           "layer_types", "qk_head_dim", "max_position_embeddings"}


def _config(name: str):
    config_cls, sizes = RELEASED[name]
    return getattr(transformers, config_cls)(**sizes)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """name -> (hf_dir, mcore_dir, architecture record), each converted once."""
    out = {}
    for name in RELEASED:
        root = tmp_path_factory.mktemp(name)
        seeded_hf_model(_config(name)).save_pretrained(root / "hf")
        out[name] = (root / "hf", root / "mcore", hf_to_mcore(root / "hf", root / "mcore", progress=False).to_record())
    return out


@pytest.mark.parametrize("name", list(RELEASED))
def test_the_shrunk_config_keeps_every_structural_field_of_the_class(name):
    config_cls, sizes = RELEASED[name]
    ours, default = _config(name).to_dict(), getattr(transformers, config_cls)().to_dict()
    changed = {k for k in default if ours.get(k) != default[k]} - SIZE_FIELDS - {"_name_or_path"}
    assert changed <= PUBLISHED & set(sizes), changed


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_structure_converts_and_matches_hf_at_cp1_and_cp4(released, name, tmp_path):
    hf_dir, mcore_dir, record = released[name]
    shape = record["shape"]
    expected_freq = {"deepseek_v3": [0, 0, 0, 1], "kimi_k2": [0, 1], "qwen3_moe_dense_layer": [1, 0, 1]}
    assert shape["moe_layer_freq"] == expected_freq.get(name, 1)
    token_ids = torch.randint(0, 96, (2, SEQ_CP), generator=torch.Generator().manual_seed(7))
    reference = _hf_logits(hf_dir, token_ids)
    per_rank = run_distributed(4, _case_family_logits, str(mcore_dir), record, token_ids)
    from mcp_context import unshard_sequence

    for i, (cp, comm, sizes) in enumerate(LAYOUTS):
        shards = [per_rank[rank][i] for rank in range(cp)]
        logits = unshard_sequence(shards, layout="zigzag", dim=1) if cp > 1 else shards[0]
        torch.testing.assert_close(logits, reference, atol=LOGIT_ATOL, rtol=0, msg=lambda m: f"{cp} {comm}: {m}")
    mcore_to_hf(mcore_dir, tmp_path / "back", progress=False)
    assert_same_tensors(load_safetensors_dir(tmp_path / "back"), load_safetensors_dir(hf_dir))
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
