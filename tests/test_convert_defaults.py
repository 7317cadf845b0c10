"""config.json is read as the installed transformers reads it: an absent field takes the value transformers'
config class computes with (not a default of ours), and a model the Megatron side cannot build is refused at
``hf-to-mcore`` time, naming the field, rather than inside megatron-core at ``verify``.

Reference: transformers' own config classes and models; logits within 1e-4 (fp32) as the other conversion tests.
"""
from __future__ import annotations

import json

import pytest
import torch

from mcp_context.convert.model_config import hf_model_from_config

pytest.register_assert_rewrite("tests.convert_fixtures")
from tests._dist import run_distributed
from tests.convert_fixtures import (_COMMON, FAMILIES, LOGIT_ATOL, MODELS, cli_error, load_safetensors_dir,
                                    tokens)
from tests.test_convert_families import _case_verify, _write_hf

transformers = pytest.importorskip("transformers", reason="transformers' config classes are the reference")
pytest_plugins = ["tests.convert_fixtures"]

ABSENT = ("rms_norm_eps", "max_position_embeddings")


@pytest.mark.parametrize("name", [*MODELS, *FAMILIES])
def test_an_absent_field_is_read_at_the_value_transformers_computes_with(name):
    config_cls, _, extra = {**MODELS, **FAMILIES}[name]
    kwargs = {k: v for k, v in {**_COMMON, **extra}.items() if k not in ABSENT}
    theirs = getattr(transformers, config_cls)(**kwargs)
    shape = hf_model_from_config({"model_type": theirs.model_type, **kwargs}).shape
    assert (shape.layernorm_epsilon, shape.max_position_embeddings) == (theirs.rms_norm_eps,
                                                                        theirs.max_position_embeddings)


def test_mixtral_without_rms_norm_eps_converts_and_verifies(converted_families, tmp_path, capsys):
    """MixtralConfig's rms_norm_eps is 1e-5 (a default of 1e-6 moves these logits by ~3e-3, 30x the tolerance)."""
    from mcp_context.convert.__main__ import main

    hf_dir = converted_families["mixtral"][0]
    config = {k: v for k, v in json.loads((hf_dir / "config.json").read_text()).items() if k != "rms_norm_eps"}
    _write_hf(tmp_path / "hf", load_safetensors_dir(hf_dir), config)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        reference = model(tokens()).logits
        for module in model.modules():
            if hasattr(module, "variance_epsilon"):
                module.variance_epsilon = 1e-6
        assert (model(tokens()).logits - reference).abs().max() > 10 * LOGIT_ATOL  # eps shows in the logits
    assert main(["hf-to-mcore", "--hf", str(tmp_path / "hf"), "--mcore", str(tmp_path / "mcore"), "--no-progress"]) == 0
    status, err = run_distributed(1, _case_verify, str(tmp_path / "hf"), str(tmp_path / "mcore"))[0]
    assert status == 0, err


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_top1_routing_megatron_core_refuses_is_refused_at_conversion(converted_families, tmp_path, capsys, name):
    """transformers renormalises the one chosen expert to weight 1; megatron-core raises "Please use
    --moe-router-pre-softmax when topk is 1" (and pre-softmax would weight it by its probability)."""
    hf_dir = converted_families[name][0]
    config = {**json.loads((hf_dir / "config.json").read_text()), "num_experts_per_tok": 1}
    _write_hf(tmp_path / "hf", load_safetensors_dir(hf_dir), config)
    err = cli_error(capsys, "hf-to-mcore", "--hf", str(tmp_path / "hf"), "--mcore", str(tmp_path / "out"),
                    "--no-progress")
    assert "config.json field num_experts_per_tok=1: transformers weights the one chosen expert by 1" in err, err
    assert not (tmp_path / "out").exists()


def test_a_shape_megatron_core_rejects_is_refused_before_anything_is_written(converted_families, tmp_path, capsys,
                                                                             monkeypatch):
    """Whatever megatron-core's TransformerConfig raises for a converted shape (here made to raise for the
    Qwen3 family) reaches the user at hf-to-mcore as one line naming megatron-core, with nothing written."""
    from megatron.core.transformer import TransformerConfig

    post_init = TransformerConfig.__post_init__

    def refusing(self):
        post_init(self)
        if self.qk_layernorm:
            raise ValueError("qk_layernorm is not supported here")

    monkeypatch.setattr(TransformerConfig, "__post_init__", refusing)
    err = cli_error(capsys, "hf-to-mcore", "--hf", str(converted_families["qwen3"][0]), "--mcore",
                    str(tmp_path / "out"), "--no-progress")
    assert "config.json describes a qwen3 that megatron-core 0.16.1 cannot build (ValueError: qk_layernorm is not " \
           "supported here); nothing is converted" in err, err
    assert not (tmp_path / "out").exists()
