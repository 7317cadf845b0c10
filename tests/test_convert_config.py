"""Conversion tests of the model description: ``config.json`` <-> the model shape (``ModelConfig``),
the architecture record, the fused-QKV mapping and the parameter names, and the refusal of what
megatron-core cannot represent.

References are the other library: ``transformers``' own parsing of the configs we write and the
sliding layers it builds, megatron-core's parameter names, explicit per-head indexing for the fused QKV.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from mcp_context.convert.converter import mcore_to_hf
from mcp_context.convert.mapping import fuse_qkv, split_qkv, tensor_maps
from mcp_context.convert.model_config import (HFModel, UnsupportedArchitectureError, hf_config_from_model,
                                              hf_model_from_config)

pytest.register_assert_rewrite("tests.convert_fixtures")  # also loaded as a plugin below: rewrite it first
from tests._dist import run_distributed
from tests.convert_fixtures import (_COMMON, WINDOW, assert_same_tensors, init_megatron,
                                    load_safetensors_dir)

pytest.importorskip("transformers", reason="the HF side of conversion tests needs transformers")
pytest.importorskip("safetensors", reason="the independent safetensors reader/writer is the reference")
pytest_plugins = ["tests.convert_fixtures"]  # the `converted` fixture, built once a session


def test_fused_qkv_is_grouped_per_query_group_by_explicit_head_indexing():
    h, g, d, hidden = 6, 2, 3, 5
    q, k, v = torch.randn(h * d, hidden), torch.randn(g * d, hidden), torch.randn(g * d, hidden)
    rows = []
    for j in range(g):  # reference: group j = its h/g query heads, then key head j, then value head j
        for head in range(j * h // g, (j + 1) * h // g):
            rows.append(q[head * d:(head + 1) * d])
        rows += [k[j * d:(j + 1) * d], v[j * d:(j + 1) * d]]
    fused = fuse_qkv(q, k, v, g)
    assert torch.equal(fused, torch.cat(rows))
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, h, g, d), (q, k, v)))
    bias = torch.randn(h * d)
    assert torch.equal(fuse_qkv(bias, torch.zeros(g * d), torch.zeros(g * d), g).reshape(g, -1)[:, :h // g * d],
                       bias.reshape(g, -1))


def test_local_and_te_parameter_names_match_a_local_spec_model():
    run_distributed(1, _case_parameter_names)


def _case_parameter_names(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mcp_context.convert.verify import build_gpt_model

    init_megatron()
    try:
        for tied in (False, True):
            shape = hf_model_from_config({"model_type": "qwen2", **_COMMON, "tie_word_embeddings": tied}).shape
            spec = get_gpt_layer_local_spec(normalization="RMSNorm")
            model = build_gpt_model(shape, spec)
            params = {n: tuple(p.shape) for n, p in model.named_parameters()}
            ours = {}
            for tmap in tensor_maps(shape):
                for layer in (range(shape.num_layers) if tmap.per_layer else [None]):
                    ours[tmap.param_name(layer, "local")] = tmap.mcore_shape
                    te = tmap.param_name(layer, "te")
                    local = tmap.param_name(layer, "local")
                    for src, dst in spec.submodules.sharded_state_dict_keys_map.items():
                        local = local.replace(src, dst)
                    assert local == te, (local, te)  # TE names are what the local spec saves under
            assert ours == params
    finally:
        parallel_state.destroy_model_parallel()


def test_generated_hf_config_round_trips_and_transformers_reads_it(converted):
    from transformers import AutoConfig

    for name, (hf_dir, _, record, _) in converted.items():
        arch = HFModel.from_record(record)
        generated = hf_config_from_model(arch)
        assert hf_model_from_config(generated) == arch, name
        theirs = AutoConfig.for_model(**generated).to_dict()  # transformers' own parsing of our fields
        assert hf_model_from_config(theirs) == arch, name
        assert arch == hf_model_from_config(json.loads((hf_dir / "config.json").read_text()))


def _sliding_layers(config: dict) -> list[int]:
    """The layers transformers gives a window (its own Qwen2/Mistral model, built from ``config``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return [int(layer.self_attn.sliding_window is not None) for layer in model.model.layers]


@pytest.mark.parametrize("max_window_layers,layers", [(0, None), (1, [0, 1, 1, 1]), (3, [0, 0, 0, 1]), (4, "none")])
def test_qwen2_sliding_layers_become_window_size_and_window_attn_skip_freq(max_window_layers, layers):
    """Qwen2 slides on layers ``i >= max_window_layers``: the shape holds the window and, unless every
    layer slides, megatron-core's 0/1 list of window layers; written back, transformers builds the
    same sliding layers (layer_types written out) and the config reads back to the same shape."""
    config = {"model_type": "qwen2", **_COMMON, "num_hidden_layers": 4, "use_sliding_window": True,
              "sliding_window": WINDOW, "max_window_layers": max_window_layers}
    shape = hf_model_from_config(config).shape
    if layers == "none":  # no layer slides: nothing to keep
        assert (shape.window_size, shape.window_attn_skip_freq) == (None, None)
        return
    assert (shape.window_size, shape.window_attn_skip_freq) == ([WINDOW - 1, 0], layers)
    written = hf_config_from_model(HFModel("qwen2", shape))
    assert _sliding_layers(written) == _sliding_layers(config) == (layers or [1] * 4)
    assert written["max_window_layers"] == max_window_layers and hf_model_from_config(written).shape == shape
    # an explicit layer_types wins over max_window_layers, as in transformers; any pattern converts
    alternating = {**config, "layer_types": ["sliding_attention", "full_attention"] * 2}
    shape = hf_model_from_config(alternating).shape
    assert shape.window_attn_skip_freq == [1, 0, 1, 0] == _sliding_layers(alternating)
    written = hf_config_from_model(HFModel("qwen2", shape))
    assert "max_window_layers" not in written and _sliding_layers(written) == [1, 0, 1, 0]


def test_a_window_the_hf_config_cannot_express_is_refused_when_writing_it():
    shape = hf_model_from_config({"model_type": "mistral", **_COMMON, "sliding_window": WINDOW}).shape
    for name, window, freq in (("mistral", [WINDOW - 1, 0], 2), ("qwen2", [3, 3], None), ("llama", [3, 0], None)):
        bad = HFModel(name, dataclasses.replace(shape, window_size=window, window_attn_skip_freq=freq))
        with pytest.raises(ValueError, match=rf"window_size=\[{window[0]}, {window[1]}\] with "
                                             rf"window_attn_skip_freq={freq} has no \w+ForCausalLM config.json"):
            hf_config_from_model(bad)


def test_a_recipe_describing_a_converted_model_gets_the_same_megatron_arguments(converted):
    """One shape and one translation: the recipe's model section for the converted Llama (as a user
    would write it) is the converter's shape, so pretraining and the converter build the same model."""
    from mcp_context.recipes import load_recipe
    from mcp_context.recipes.schema import gpt_model_kwargs, transformer_config_kwargs

    arch = HFModel.from_record(converted["llama_gqa_rope3"][2])
    recipe = load_recipe(None, [
        "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=96", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.kv_channels=16", "model.seq_length=128", "model.vocab_size=96",
        "model.max_position_embeddings=128", "model.rotary_base=500000", "model.rope_scaling=true",
        "model.layernorm_epsilon=1e-5", "model.context_parallel_size=1", "model.cp_comm_type=p2p",
        "model.hierarchical_context_parallel_sizes=null"])
    assert recipe.model == arch.shape
    assert transformer_config_kwargs(recipe.model) == transformer_config_kwargs(arch.shape)
    assert gpt_model_kwargs(recipe.model, recipe.padded_vocab_size(90)) == \
        gpt_model_kwargs(arch.shape, arch.shape.vocab_size)
    window = HFModel.from_record(converted["qwen2_upper_window"][2]).shape  # the window fields pass through too
    kwargs = transformer_config_kwargs(window)
    assert (kwargs["window_size"], kwargs["window_attn_skip_freq"]) == ((WINDOW - 1, 0), [0, 1, 1])


# Architecture records as converters before the shared model shape wrote them (a flat list of HF-side numbers).
_LEGACY_RECORDS = {
    "mistral_window": {"model_type": "mistral", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
                       "num_layers": 2, "num_attention_heads": 4, "num_query_groups": 2, "head_dim": 16,
                       "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "max_position_embeddings": 128,
                       "rope_scaling_factor": None, "qkv_bias": False, "tie_word_embeddings": False,
                       "sliding_window": 8},
    "llama_gqa_rope3": {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
                        "num_layers": 2, "num_attention_heads": 4, "num_query_groups": 2, "head_dim": 16,
                        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 128,
                        "rope_scaling_factor": 8.0, "qkv_bias": False, "tie_word_embeddings": False,
                        "sliding_window": None},
}


def test_a_checkpoint_converted_with_the_earlier_architecture_record_still_converts_back(converted, tmp_path):
    for name, legacy in _LEGACY_RECORDS.items():
        hf_dir, mcore_dir, record, _ = converted[name]
        assert HFModel.from_record(legacy) == HFModel.from_record(record), name
    hf_dir, mcore_dir, record, _ = converted["mistral_window"]
    old = shutil.copytree(mcore_dir, tmp_path / "old")
    (old / "mcp_context" / "architecture.json").write_text(json.dumps(_LEGACY_RECORDS["mistral_window"]))
    (old / "mcp_context" / "hf" / "config.json").unlink()  # the record alone describes the model
    arch = mcore_to_hf(old, tmp_path / "back", progress=False)
    assert arch.shape.window_size == [7, 0]
    assert_same_tensors(load_safetensors_dir(tmp_path / "back"), load_safetensors_dir(hf_dir))
    assert hf_model_from_config(json.loads((tmp_path / "back" / "config.json").read_text())) == arch


def test_unsupported_architectures_are_refused_naming_the_field():
    base = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    cases = [({"model_type": "gemma"}, "model_type='gemma'"),
             ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type='longrope'"),
             ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}}, "low_freq_factor"),
             ({"attention_bias": True}, "attention_bias=True"),
             ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
             ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
             ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
             ({"model_type": "qwen2", "num_key_value_heads": 2, "layer_types": ["sliding_attention"]},
              "layer_types=['sliding_attention']: names sliding_attention layers but use_sliding_window is false"),
             ({"model_type": "qwen2", "num_key_value_heads": 2, "use_sliding_window": True, "layer_types": ["local"]},
              "layer_types=['local']: must list 'full_attention' or 'sliding_attention' for each of the "
              "num_hidden_layers=1 layers")]
    for override, needle in cases:
        with pytest.raises(UnsupportedArchitectureError, match=needle.replace("(", "\\(").replace("[", "\\[")):
            hf_model_from_config({**base, **override})
    for override, needle in (({"use_sliding_window": "yes"}, "use_sliding_window='yes': must be true or false"),
                             ({"use_sliding_window": True, "max_window_layers": 0, "sliding_window": 0},
                              "sliding_window=0: must be an integer >= 1")):
        with pytest.raises(ValueError, match=needle):
            hf_model_from_config({**base, "model_type": "qwen2", "num_key_value_heads": 2, **override})
    # transformers-5 style rope_parameters are read like the legacy fields
    shape = hf_model_from_config({**base, "rope_parameters": {"rope_type": "llama3", "factor": 32.0, "rope_theta": 5e5,
                                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 8192}}).shape
    assert (shape.rotary_base, shape.rope_scaling, shape.rope_scaling_factor) == (5e5, True, 32.0)
