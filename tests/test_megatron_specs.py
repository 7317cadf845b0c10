"""Every layer spec name the docs list resolves the way Megatron-LM resolves ``--spec MODULE NAME``:
megatron-core's ``spec_utils.import_module``, which reads ``vars(module)[NAME]`` (a lazy module
``__getattr__`` is never consulted there, which made the TE names a ``KeyError``).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron.core.transformer.spec_utils import ModuleSpec, build_module, import_module

from mcp_context.megatron import specs
from mcp_context.megatron.core_attention import HCPDotProductAttention
from mcp_context.megatron.spec_facts import SPEC_VARIANTS
from tests._dist import run_distributed

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _documented_spec_names() -> set[str]:
    text = (DOCS / "megatron.md").read_text() + (DOCS / "recipes.md").read_text()
    return set(re.findall(r"\bhcp_\w+_spec\b", text))


def test_the_docs_list_exactly_the_module_level_specs():
    assert _documented_spec_names() == set(specs.SPEC_NAMES) == {
        "hcp_local_spec", "hcp_qknorm_local_spec", "hcp_moe_local_spec", "hcp_qknorm_moe_local_spec",
        "hcp_mla_local_spec", "hcp_mla_moe_local_spec", "hcp_te_spec", "hcp_te_attention_spec"}


@pytest.mark.parametrize("name", sorted(_documented_spec_names()))
def test_every_documented_spec_resolves_through_megatron_import_module(name):
    spec = import_module(("mcp_context.megatron.specs", name))
    assert isinstance(spec, ModuleSpec) and spec is vars(specs)[name]


@pytest.mark.parametrize("name", sorted(SPEC_VARIANTS))
def test_local_specs_use_our_core_attention_and_carry_what_they_build(name):
    spec = import_module(("mcp_context.megatron.specs", name))
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.module is HCPDotProductAttention and core.params["layer_spec"] == SPEC_VARIANTS[name]


@pytest.mark.parametrize("name", ["hcp_te_spec", "hcp_te_attention_spec"])
def test_te_specs_without_te_fail_clearly_when_used(name):
    if specs._te_import_error() is None:
        spec = import_module(("mcp_context.megatron.specs", name))
        assert not isinstance(spec, specs.UnavailableSpec) and spec.submodules is not None
        return
    spec = import_module(("mcp_context.megatron.specs", name))
    assert isinstance(spec, specs.UnavailableSpec)
    for use in (lambda: spec.module, lambda: spec.submodules, lambda: build_module(spec)):
        with pytest.raises(RuntimeError, match=rf"{name} needs Transformer Engine, which is not importable here "
                                               rf"\(.*\); install mcp_context\[te\].* or use --spec "
                                               rf"mcp_context.megatron.specs hcp_local_spec"):
            use()
    assert "needs Transformer Engine" in repr(spec)


def test_te_specs_resolve_to_what_get_gpt_layer_hcp_spec_builds_with_te():
    if specs._te_import_error() is not None:
        with pytest.raises(RuntimeError, match=r"needs Transformer Engine"):
            specs.get_gpt_layer_hcp_spec(use_te=True)
        return
    te = import_module(("mcp_context.megatron.specs", "hcp_te_spec"))
    assert te.submodules.self_attention.submodules.core_attention.module is HCPDotProductAttention
    te_attn = import_module(("mcp_context.megatron.specs", "hcp_te_attention_spec"))
    assert getattr(te_attn.submodules.self_attention.submodules.core_attention, "module", None) \
        is not HCPDotProductAttention


MOE = dict(num_moe_experts=2, moe_router_topk=2, moe_ffn_hidden_size=16)
# (spec name, config fields, the message): each fixed spec refuses, at model build, a config it does not build
# for, naming the field and the spec that serves it.
MISFITS = [
    ("hcp_local_spec", dict(qk_layernorm=True),
     r"TransformerConfig.qk_layernorm=True, but layer spec hcp_local_spec builds no q/k norms: the model would not "
     r"be the one configured; use --spec mcp_context.megatron.specs hcp_qknorm_local_spec \(or "
     r"get_gpt_layer_hcp_spec\(qk_layernorm=True\)\)"),
    ("hcp_local_spec", dict(qk_l2_norm=True),
     r"qk_l2_norm=True, but layer spec hcp_local_spec builds no q/k L2 norms.*use "
     r"get_gpt_layer_hcp_spec\(qk_l2_norm=True\)"),
    ("hcp_local_spec", MOE, r"num_moe_experts=2, but layer spec hcp_local_spec builds a dense MLP.*use --spec "
                            r"mcp_context.megatron.specs hcp_moe_local_spec"),
    ("hcp_qknorm_local_spec", MOE | dict(qk_layernorm=True),
     r"num_moe_experts=2, but layer spec hcp_qknorm_local_spec builds a dense MLP.*hcp_qknorm_moe_local_spec"),
    ("hcp_moe_local_spec", {}, r"num_moe_experts=None, but layer spec hcp_moe_local_spec builds a MoE MLP.*"
                               r"hcp_local_spec"),
    ("hcp_moe_local_spec", MOE | dict(moe_layer_freq=2),
     r"moe_layer_freq=2, but layer spec hcp_moe_local_spec puts the MoE MLP in every layer"),
    ("hcp_moe_local_spec", MOE | dict(moe_grouped_gemm=True),
     r"moe_grouped_gemm=True, but layer spec hcp_moe_local_spec builds sequential local experts.*"
     r"get_gpt_layer_hcp_spec\(num_experts=<num_moe_experts>, moe_grouped_gemm=True\)"),
    ("hcp_local_spec", "mla", r"multi_latent_attention=True, but layer spec hcp_local_spec builds plain \(GQA\) "
                              r"attention.*use --spec mcp_context.megatron.specs hcp_mla_local_spec \(or "
                              r"get_gpt_layer_hcp_spec\(qk_layernorm=True, multi_latent_attention=True\)\)"),
    ("hcp_mla_local_spec", {}, r"multi_latent_attention=False, but layer spec hcp_mla_local_spec builds "
                               r"multi-latent attention"),
]


def _misfit_messages(rank, world, misfits):
    import megatron_patches
    from megatron.core import parallel_state

    from mcp_context.megatron import HCPConfigError
    from tests.tiny_gpt import ParityCase, case_config, init_parallel, tiny_config, tiny_gpt

    megatron_patches.apply_all(device="cpu")
    init_parallel()
    messages = []
    try:
        for name, fields, _ in misfits:
            config = case_config(ParityCase("mla", mla=True)) if fields == "mla" else tiny_config(**fields)
            if name == "hcp_mla_local_spec":
                config = tiny_config(qk_layernorm=True)
            try:
                tiny_gpt(config, vars(specs)[name])
                messages.append("built without an error")
            except HCPConfigError as err:
                messages.append(str(err))
    finally:
        parallel_state.destroy_model_parallel()
    return messages


def test_fixed_specs_refuse_configs_they_do_not_build():
    """Megatron-LM's --spec uses our module-level objects as they are: a config asking for q/k norms, experts,
    another expert kind, MoE on some layers only, or MLA from a spec that builds otherwise is refused when the
    model is built (the issue: hcp_local_spec silently built no q/k norms and a dense MLP)."""
    messages = run_distributed(2, _misfit_messages, MISFITS)[0]
    for (name, _, pattern), message in zip(MISFITS, messages):
        assert re.search(pattern, message), f"{name}: {message}"


def _block_structure(rank, world):
    import megatron_patches
    from megatron.core import parallel_state

    from mcp_context.megatron import HCPConfigError
    from tests.tiny_gpt import init_parallel, tiny_config, tiny_gpt

    megatron_patches.apply_all(device="cpu")
    init_parallel()
    try:
        config = tiny_config(**MOE, moe_layer_freq=[0, 1])
        gpt = tiny_gpt(config, specs.get_gpt_decoder_block_hcp_spec(config))
        layers = [(type(layer.mlp).__name__, type(layer.self_attention.core_attention).__name__)
                  for layer in gpt.decoder.layers]
        try:  # the block built for [0, 1] with a config that says [1, 0]
            tiny_gpt(tiny_config(**MOE, moe_layer_freq=[1, 0]), specs.get_gpt_decoder_block_hcp_spec(config))
            refusal = "built without an error"
        except HCPConfigError as err:
            refusal = str(err)
        return layers, refusal
    finally:
        parallel_state.destroy_model_parallel()


def test_the_block_spec_builds_dense_layers_among_moe_ones_with_our_attention():
    """get_gpt_decoder_block_hcp_spec: megatron-core's per-layer block (moe_layer_freq as a list), each layer with
    the HCP core attention, which refuses a config whose pattern is not the block's."""
    layers, refusal = run_distributed(1, _block_structure)[0]
    assert layers == [("MLP", "HCPDotProductAttention"), ("MoELayer", "HCPDotProductAttention")]
    assert re.search(r"moe_layer_freq=\[1, 0\], but layer spec get_gpt_decoder_block_hcp_spec\(config\) puts MoE "
                     r"layers as moe_layer_freq=\[0, 1\]", refusal), refusal
