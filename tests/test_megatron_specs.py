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

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _documented_spec_names() -> set[str]:
    text = (DOCS / "megatron.md").read_text() + (DOCS / "recipes.md").read_text()
    return set(re.findall(r"\bhcp_\w+_spec\b", text))


def test_the_docs_list_exactly_the_module_level_specs():
    assert _documented_spec_names() == set(specs.SPEC_NAMES) == {"hcp_local_spec", "hcp_te_spec",
                                                                  "hcp_te_attention_spec"}


@pytest.mark.parametrize("name", sorted(_documented_spec_names()))
def test_every_documented_spec_resolves_through_megatron_import_module(name):
    spec = import_module(("mcp_context.megatron.specs", name))
    assert isinstance(spec, ModuleSpec) and spec is vars(specs)[name]


def test_local_spec_uses_our_core_attention():
    spec = import_module(("mcp_context.megatron.specs", "hcp_local_spec"))
    assert spec.submodules.self_attention.submodules.core_attention is HCPDotProductAttention


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
    assert te.submodules.self_attention.submodules.core_attention is HCPDotProductAttention
    te_attn = import_module(("mcp_context.megatron.specs", "hcp_te_attention_spec"))
    assert te_attn.submodules.self_attention.submodules.core_attention is not HCPDotProductAttention
