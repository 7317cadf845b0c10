"""Conversion tests of issue 21's families (Qwen3, Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3): per family,
the round trip is bit for bit (fp32 from transformers, bf16 from random weights), ``config.json``
round-trips, the converted model gives Hugging Face's logits within 1e-4 at CP = 1 and 4 (p2p, and
a2a+p2p [2, 2]) in one four-rank run, and malformed expert checkpoints or configs are refused in one line
(exit 2); DeepSeek-V3's MTP layers are dropped with a notice; Mixtral loads at EP = 2.

References: ``transformers`` running the original checkpoint (fp32, eager attention) and parsing the
configs we write; the ``safetensors`` package reading the files.
"""
from __future__ import annotations

import json

import pytest
import torch

from mcp_context.convert.__main__ import main
from mcp_context.convert.converter import hf_to_mcore, mcore_to_hf
from mcp_context.convert.hf_quirks import ignored_fields
from mcp_context.convert.model_config import HFModel, hf_config_from_model, hf_model_from_config

pytest.register_assert_rewrite("tests.convert_fixtures")  # also loaded as a plugin below: rewrite it first
from tests._dist import run_distributed
from tests.convert_fixtures import (cli_error, DEEPSEEK_V3_YARN, FAMILIES, LOGIT_ATOL, WINDOW, assert_same_tensors, build_hf_model,
                                    init_megatron, load_safetensors_dir, tokens)

pytest.importorskip("transformers", reason="the HF side of conversion tests needs transformers")
pytest.importorskip("safetensors", reason="the independent safetensors reader/writer is the reference")
pytest_plugins = ["tests.convert_fixtures"]  # the `converted_families` fixture, built once a session

SEQ_CP = 48  # zigzag chunks of 6 tokens at CP = 4: the window of 8 spans two
# (cp, cp_comm_type, hierarchy) run one after another on the same four ranks (CP 1: four data-parallel copies).
# A ring of 2 is not repeated here: the model at CP = 2 is tests/test_megatron_gpt.py's, the ring
# tests/test_engine_dist.py's.
LAYOUTS = [(1, "p2p", None), (4, "p2p", None), (4, "a2a+p2p", [2, 2])]
# HF tensors each family's logits must depend on, checked by resetting them (a dropped tensor would show)
SENSITIVE = {"qwen3": ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
             "mixtral": ("block_sparse_moe.gate.weight", "post_attention_layernorm.weight"),
             "qwen3_moe": ("self_attn.k_norm.weight", "mlp.gate.weight"),
             "gpt_oss": ("self_attn.sinks", "mlp.router.bias", "mlp.experts.gate_up_proj_bias",
                         "self_attn.o_proj.bias"),
             "deepseek_v3": ("self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight",
                             "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight")}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_converts_back_bit_for_bit_in_fp32_and_bf16(converted_families, name, tmp_path):
    from mcp_context.convert.random_checkpoint import write_random_hf_checkpoint

    hf_dir, mcore_dir, _, _ = converted_families[name]
    mcore_to_hf(mcore_dir, tmp_path / "back", max_shard_bytes=60_000, progress=False)  # several shards
    assert len(list((tmp_path / "back").glob("*.safetensors"))) > 1
    assert_same_tensors(load_safetensors_dir(tmp_path / "back"), load_safetensors_dir(hf_dir))
    assert (tmp_path / "back" / "config.json").read_bytes() == (hf_dir / "config.json").read_bytes()
    config = json.loads((hf_dir / "config.json").read_text())
    write_random_hf_checkpoint(tmp_path / "bf16", config, torch.bfloat16)  # bf16 stays bf16
    hf_to_mcore(tmp_path / "bf16", tmp_path / "bf16_mcore", progress=False)
    mcore_to_hf(tmp_path / "bf16_mcore", tmp_path / "bf16_back", progress=False)
    back, original = load_safetensors_dir(tmp_path / "bf16_back"), load_safetensors_dir(tmp_path / "bf16")
    assert {t.dtype for t in original.values()} == {torch.bfloat16}
    assert_same_tensors(back, original)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_config_round_trips_and_transformers_reads_it(converted_families, name):
    from transformers import AutoConfig

    hf_dir, _, record, _ = converted_families[name]
    arch = HFModel.from_record(record)
    assert arch == hf_model_from_config(json.loads((hf_dir / "config.json").read_text()))
    generated = hf_config_from_model(arch)
    assert hf_model_from_config(generated) == arch
    assert hf_model_from_config(AutoConfig.for_model(**generated).to_dict()) == arch  # transformers' parsing
    shape = arch.shape
    assert shape.qk_layernorm == (name in ("qwen3", "qwen3_moe", "deepseek_v3"))  # MLA: the latent norms
    experts = {"qwen3": (None, 2), "deepseek_v3": (8, 2)}.get(name, (4, 2))
    assert (shape.num_moe_experts, shape.moe_router_topk) == experts
    assert shape.moe_router_pre_softmax == (name == "qwen3_moe")  # norm_topk_prob=false: no renormalisation
    assert (shape.window_size, shape.window_attn_skip_freq) == {
        "qwen3": ([WINDOW - 1, 0], [0, 1]), "mixtral": ([WINDOW - 1, 0], None), "qwen3_moe": (None, None),
        "gpt_oss": ([WINDOW - 1, 0], [1, 0]), "deepseek_v3": (None, None)}[name]
    gpt_oss = (shape.softmax_type, shape.add_bias_linear, shape.activation_func, shape.glu_linear_offset,
               shape.activation_func_clamp_value)
    assert gpt_oss == (("learnable", True, "quick_gelu", 1.0, 1.5) if name == "gpt_oss" else
                       ("vanilla", False, "silu", 0.0, None))
    deepseek = (shape.multi_latent_attention, shape.q_lora_rank, shape.kv_lora_rank, shape.qk_head_dim,
                shape.qk_pos_emb_head_dim, shape.v_head_dim, shape.moe_router_score_function,
                shape.moe_router_enable_expert_bias, shape.moe_router_num_groups, shape.moe_router_group_topk,
                shape.moe_router_topk_scaling_factor, shape.moe_shared_expert_intermediate_size)
    if name == "deepseek_v3":
        assert deepseek == (True, 32, 24, 16, 8, 16, "sigmoid", True, 2, 1, 2.5, 48)
    else:
        assert not shape.multi_latent_attention and shape.moe_router_score_function == "softmax"


def _hf_logits(hf_dir, token_ids: torch.Tensor, reset: str = "", **config_override) -> torch.Tensor:
    """transformers' fp32 logits; ``reset``: that tensor of every layer set to ones first;
    ``config_override``: config fields changed before the model is built."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(hf_dir))
    for field, value in config_override.items():
        setattr(config, field, value)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), config=config, dtype=torch.float32,
                                                 attn_implementation="eager")
    if reset:
        from safetensors.torch import load_file

        with torch.no_grad():
            for file in hf_dir.glob("*.safetensors"):
                for key in load_file(file):
                    if key.endswith(reset):
                        name = key.replace("block_sparse_moe.", "mlp.")
                        owner = model.get_submodule(name.rsplit(".", 1)[0])
                        getattr(owner, name.rsplit(".", 1)[1]).fill_(1.0)  # a parameter or a saved buffer
    with torch.no_grad():
        return model.eval()(token_ids).logits.float()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_logits_match_hf_at_cp1_and_cp4(converted_families, name):
    """One four-rank run per family: CP = 1, 4 (p2p) and 4 as a2a+p2p [2, 2], each matching HF within 1e-4."""
    from mcp_context import unshard_sequence

    hf_dir, mcore_dir, arch, _ = converted_families[name]
    quirks = ignored_fields(json.loads((hf_dir / "config.json").read_text()))
    if quirks:  # e.g. transformers 5.17's gpt-oss clamps at 7.0 whatever swiglu_limit says: no reference here
        pytest.skip(quirks[0])
    token_ids = tokens(SEQ_CP)
    reference = _hf_logits(hf_dir, token_ids)
    for tensor in SENSITIVE[name]:  # the q/k norms, routers and norms carry the answer: dropping one would fail
        assert (_hf_logits(hf_dir, token_ids, reset=tensor) - reference).abs().max() > 100 * LOGIT_ATOL, tensor
    rope = json.loads((hf_dir / "config.json").read_text()).get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn":  # YaRN (its frequencies and attention factor) changes the answer
        plain = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
        assert (_hf_logits(hf_dir, token_ids, rope_parameters=plain) - reference).abs().max() > 100 * LOGIT_ATOL
    if name == "deepseek_v3":  # and so does mscale_all_dim, which transformers also puts in the softmax scale
        assert (_hf_logits(hf_dir, token_ids, rope_parameters={**rope, "mscale_all_dim": 0.0}) -
                reference).abs().max() > 100 * LOGIT_ATOL
    if name == "gpt_oss":  # the GLU's clamp is reached, and the window changes the answer
        assert (_hf_logits(hf_dir, token_ids, swiglu_limit=100.0) - reference).abs().max() > 100 * LOGIT_ATOL
        assert (_hf_logits(hf_dir, token_ids, layer_types=["full_attention"] * 2) - reference).abs().max() > \
            100 * LOGIT_ATOL
    per_rank = run_distributed(4, _case_family_logits, str(mcore_dir), arch, token_ids)
    for i, (cp, comm, sizes) in enumerate(LAYOUTS):
        shards = [per_rank[rank][i] for rank in range(cp)]  # ranks 0..cp-1 form one CP group
        logits = unshard_sequence(shards, layout="zigzag", dim=1) if cp > 1 else shards[0]
        torch.testing.assert_close(logits, reference, atol=LOGIT_ATOL, rtol=0, msg=lambda m: f"{cp} {comm}: {m}")


def _case_family_logits(rank, world_size, mcore_dir, arch, token_ids):
    from megatron.core import parallel_state

    from mcp_context import shard_sequence
    from mcp_context.convert.verify import load_mcore_model
    from mcp_context.recipes.schema import decoder_spec

    shape = HFModel.from_record(arch).shape
    out = []
    for cp, comm, sizes in LAYOUTS:
        init_megatron(cp=cp, hierarchical_context_parallel_sizes=sizes)
        try:
            cp_rank = parallel_state.get_context_parallel_rank()
            spec = lambda config: decoder_spec(shape, config)  # our HCP layer spec, or block of per-layer specs
            model = load_mcore_model(mcore_dir, shape, spec, context_parallel_size=cp, cp_comm_type=comm,
                                     hierarchical_context_parallel_sizes=sizes)
            shard = dict(cp_size=cp, cp_rank=cp_rank, layout="zigzag", dim=1)
            positions = torch.arange(token_ids.shape[1]).expand_as(token_ids)
            with torch.no_grad():
                out.append(model(shard_sequence(token_ids, **shard), shard_sequence(positions, **shard), None).float())
        finally:
            parallel_state.destroy_model_parallel()
    return out



def _write_hf(path, tensors: dict, config: dict) -> None:
    from safetensors.torch import save_file

    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


EXPERT = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
ROUTER = "model.layers.0.block_sparse_moe.gate.weight"
MALFORMED = {  # case -> (edit of the Mixtral tensors, config overrides, the words the error must hold)
    "missing_expert": (lambda t: t.pop(EXPERT), {}, f"lacks 1 tensor(s) a mixtral with num_hidden_layers=2 "
                                                  f"needs, e.g. ['{EXPERT}']"),
    "fewer_experts_in_config": (None, {"num_local_experts": 3}, f"tensor '{ROUTER}' has shape [4, 64] but "
                                                                f"config.json implies [3, 64]"),
    "more_experts_in_config": (None, {"num_local_experts": 5}, "lacks 6 tensor(s)"),
    "router_shape": (lambda t: t.update({ROUTER: t[ROUTER][:3]}), {},
                     f"tensor '{ROUTER}' has shape [3, 64] but config.json implies [4, 64] (hidden_size=64, "),
    "topk_above_experts": (None, {"num_experts_per_tok": 5}, "num_experts_per_tok=5: must be at most the expert "
                                                             "count 4"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_expert_checkpoints_are_refused_in_one_line(converted_families, tmp_path, capsys, case):
    edit, overrides, needle = MALFORMED[case]
    hf_dir, mcore_dir, _, _ = converted_families["mixtral"]
    tensors = load_safetensors_dir(hf_dir)
    if edit is not None:
        edit(tensors)
    config = {**json.loads((hf_dir / "config.json").read_text()), **overrides}
    _write_hf(tmp_path / "hf", tensors, config)
    err = cli_error(capsys, "hf-to-mcore", "--hf", str(tmp_path / "hf"), "--mcore", str(tmp_path / "out"), "--no-progress")
    assert needle in err and ("experts=" in err or "tensor '" not in err), err
    if overrides:  # the same config against the good Megatron checkpoint: refused naming the expert tensor
        (tmp_path / "cfg.json").write_text(json.dumps(config))
        err = cli_error(capsys, "mcore-to-hf", "--mcore", str(mcore_dir), "--hf", str(tmp_path / "back"),
                   "--hf-config", str(tmp_path / "cfg.json"), "--no-progress")
        assert ("decoder.layers.mlp" in err and "global shape" in err) or "num_experts_per_tok" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "back").exists()


@pytest.mark.parametrize("name,overrides,needle", [
    ("qwen3", {"layer_types": ["sliding_attention"]}, "layer_types=['sliding_attention']: must list "
                                                      "'full_attention' or 'sliding_attention' for each of the "
                                                      "num_hidden_layers=2 layers"),
    ("qwen3_moe", {"mlp_only_layers": [0, 1]}, "mlp_only_layers=[0, 1]: leaves no MoE layer among the "
                                                "num_hidden_layers=2"),
    ("qwen3_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob='yes': must be true or false"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ("gpt_oss", {"layer_types": ["full_attention"] * 3}, "layer_types=['full_attention', 'full_attention', "
                                                         "'full_attention']: must list"),
    ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config={'quant_method': 'mxfp4'}: "
                                                                    "quantized weights"),
    ("gpt_oss", {"attention_bias": False}, "attention_bias=False: gpt-oss's experts and router have biases"),
    ("gpt_oss", {"swiglu_alpha": 2.0}, "swiglu_alpha=2.0: megatron-core's quick_gelu hard-codes 1.702"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "rope_theta": 150000.0}},
     "rope_parameters.original_max_position_embeddings=None: YaRN needs the pre-extension context length"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "rope_theta": 150000.0,
                                     "original_max_position_embeddings": 4096, "attention_factor": 1.0}},
     "rope_parameters.attention_factor=1.0: transformers scales cos/sin by 1"),
    ("deepseek_v3", {"first_k_dense_replace": 2}, "first_k_dense_replace=2: leaves no MoE layer"),
    ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob=False: only norm_topk_prob=True"),
    ("deepseek_v3", {"topk_group": 2}, "topk_group=2: transformers scores a group by its top 2 experts"),
    ("deepseek_v3", {"rope_parameters": {**DEEPSEEK_V3_YARN, "truncate": False}},
     "rope_parameters.truncate=False: megatron-core's MLA YaRN always rounds"),
    ("deepseek_v3", {"rope_parameters": {**DEEPSEEK_V3_YARN, "mscale": 0.0}},
     "rope_parameters.mscale=0.0: transformers scales cos/sin by 1.36889; megatron-core computes"),
])
def test_malformed_family_configs_are_refused_naming_the_field(converted_families, tmp_path, capsys, name,
                                                               overrides, needle):
    hf_dir = converted_families[name][0]
    config = {**json.loads((hf_dir / "config.json").read_text()), **overrides}
    _write_hf(tmp_path / "hf", load_safetensors_dir(hf_dir), config)
    err = cli_error(capsys, "hf-to-mcore", "--hf", str(tmp_path / "hf"), "--mcore", str(tmp_path / "out"), "--no-progress")
    assert needle in err, err


@pytest.mark.parametrize("name,changed", [("mixtral", EXPERT), ("gpt_oss", "model.layers.1.mlp.experts.down_proj"),
                                          ("deepseek_v3", "model.layers.1.mlp.experts.5.up_proj.weight")])
def test_verify_names_the_first_mismatching_expert_tensor(converted_families, tmp_path, name, changed):
    hf_dir, mcore_dir, _, _ = converted_families[name]
    _write_hf(tmp_path / "same", load_safetensors_dir(hf_dir), json.loads((hf_dir / "config.json").read_text()))
    status, err = run_distributed(1, _case_verify, str(tmp_path / "same"), str(mcore_dir))[0]
    quirks = ignored_fields(json.loads((hf_dir / "config.json").read_text()))
    if quirks:  # the installed transformers ignores a field (transformers 5.17, gpt-oss): verify says which
        assert status == 1 and quirks[0] in err, err
    else:
        assert status == 0, err  # verify itself passes on the converted pair (gpt-oss: sinks, so our spec at CP=1)
    tensors = load_safetensors_dir(hf_dir)
    tensors[changed] = tensors[changed] + 1.0  # the same model with one expert tensor changed
    _write_hf(tmp_path / "hf", tensors, json.loads((hf_dir / "config.json").read_text()))
    status, err = run_distributed(1, _case_verify, str(tmp_path / "hf"), str(mcore_dir))[0]
    assert status == 1
    assert f"1 tensor(s) differ between --hf and --mcore, e.g. ['{changed}'] (the first in checkpoint order: " \
           f"{changed})" in err, err


def _case_verify(rank, world_size, hf_dir, mcore_dir):
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(["verify", "--hf", hf_dir, "--mcore", mcore_dir])
    return status, err.getvalue()


def test_build_hf_model_draws_every_family_parameter():
    """The fixture's weights are not transformers' init (norms at 1, biases at 0), so each tensor matters."""
    for name in FAMILIES:
        model = build_hf_model(name)
        norms = [p for n, p in model.named_parameters() if "norm" in n]
        assert norms and all((p != 1.0).all() for p in norms), name


def test_family_parameter_names_and_shapes_match_a_built_model(converted_families):
    run_distributed(1, _case_parameter_names, {name: converted_families[name][2] for name in FAMILIES})


def _case_parameter_names(rank, world_size, records):
    from megatron.core import parallel_state

    from mcp_context.convert.mapping import slots, tensor_maps
    from mcp_context.convert.verify import build_gpt_model

    init_megatron()
    try:
        for name, record in records.items():
            arch = HFModel.from_record(record)
            state = build_gpt_model(arch.shape).state_dict()  # parameters and saved buffers (the router's bias)
            params = {n: tuple(t.shape) for n, t in state.items() if not n.endswith("_extra_state")}
            ours = {}
            for tmap in tensor_maps(arch.shape, arch.model_type):
                for slot in slots(tmap, arch.shape):
                    layer = slot[0] if slot else None
                    # one expert per slot, or (gpt-oss) every expert of the layer in one slot
                    experts = slot[1:] or (range(tmap.experts) if tmap.experts else [None])
                    for expert in experts:
                        ours[tmap.param_name(layer, "local", expert)] = tmap.mcore_shape
            assert ours == params, name
    finally:
        parallel_state.destroy_model_parallel()


def test_mixtral_loads_at_expert_parallel_2_and_matches_hf(converted_families):
    """The stored expert axis is global: at EP=2 each rank loads its half of the experts (checked against
    the HF tensors) and the model still gives HF's logits (CP=1, megatron-core's allgather dispatcher)."""
    hf_dir, mcore_dir, arch, reference = converted_families["mixtral"]
    hf = load_safetensors_dir(hf_dir)
    for ep_rank, (logits, experts) in enumerate(run_distributed(2, _case_ep2, str(mcore_dir), arch, tokens())):
        torch.testing.assert_close(logits, reference, atol=LOGIT_ATOL, rtol=0)
        for local, fc2 in enumerate(experts):  # expert 2 * ep_rank + local of layer 0
            assert torch.equal(fc2, hf[f"model.layers.0.block_sparse_moe.experts.{2 * ep_rank + local}.w2.weight"])


def _case_ep2(rank, world_size, mcore_dir, arch, token_ids):
    from megatron.core import parallel_state

    from mcp_context.convert.verify import load_mcore_model, mcore_logits

    init_megatron(expert_model_parallel_size=2)
    try:
        model = load_mcore_model(mcore_dir, HFModel.from_record(arch).shape, expert_model_parallel_size=2)
        experts = [e.linear_fc2.weight.detach().clone() for e in model.decoder.layers[0].mlp.experts.local_experts]
        return mcore_logits(model, token_ids), experts
    finally:
        parallel_state.destroy_model_parallel()


def test_deepseek_mtp_layers_are_dropped_with_a_notice_and_others_refused(converted_families, tmp_path, capsys):
    """DeepSeek-V3 checkpoints carry multi-token-prediction layers after the main ones (transformers skips
    them too): converted with a printed notice naming them, the rest bit for bit; a layer beyond them is an error."""
    hf_dir = converted_families["deepseek_v3"][0]
    tensors = load_safetensors_dir(hf_dir)
    mtp = {"model.layers.2.eh_proj.weight": torch.randn(64, 128), "model.layers.2.enorm.weight": torch.randn(64),
           "model.layers.2.shared_head.norm.weight": torch.randn(64)}
    config = {**json.loads((hf_dir / "config.json").read_text()), "num_nextn_predict_layers": 1}
    _write_hf(tmp_path / "hf", {**tensors, **mtp}, config)
    assert main(["hf-to-mcore", "--hf", str(tmp_path / "hf"), "--mcore", str(tmp_path / "mcore"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "notice: dropping the 3 tensor(s) of DeepSeek-V3's multi-token-prediction layer(s) (model.layers.2.*" in err
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    assert_same_tensors(load_safetensors_dir(tmp_path / "back"), tensors)
    _write_hf(tmp_path / "hf3", {**tensors, **mtp, "model.layers.3.enorm.weight": torch.randn(64)}, config)
    err = cli_error(capsys, "hf-to-mcore", "--hf", str(tmp_path / "hf3"), "--mcore", str(tmp_path / "out"), "--no-progress")
    assert "has 1 tensor(s) a deepseek_v3 does not use, e.g. ['model.layers.3.enorm.weight']" in err, err
