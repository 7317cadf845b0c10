"""Context-parallel settings megatron-core would accept but we cannot run are refused at build time,
each with a message that names the field, the value and the fix (the specs: tests/test_megatron_specs.py)."""
import re
from types import SimpleNamespace

import pytest
import torch

import megatron_patches
from mcp_context.megatron import HCPConfigError, HCPDotProductAttention, normalize_cp_comm_type, validate_cp_config
from tests._dist import run_distributed
from tests.tiny_gpt import init_parallel, tiny_config


def _config(**kw):
    fields = dict(context_parallel_size=4, num_attention_heads=8, num_query_groups=8)
    fields.update(kw)
    return tiny_config(**fields)


@pytest.mark.parametrize("fields,seq,pattern", [
    (dict(cp_comm_type="bogus"), None, r"cp_comm_type='bogus' is not a known cp_comm_type; choose one of p2p, a2a, "
                                       r"all_gather, a2a\+p2p, a2a\+all_gather \(aliases: allgather = all_gather\)"),
    (dict(cp_comm_type="a2a_p2p"), None, r"did you mean 'a2a\+p2p'\?"),
    (dict(cp_comm_type="a2a+p2p"), None,
     r"cp_comm_type='a2a\+p2p' needs hierarchical_context_parallel_sizes with at least 2 levels \(got None\); "
     r"megatron-core would silently train without context parallelism; set it, e.g. \[2, 2\]"),
    (dict(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[3, 3]), None,
     r"hierarchical_context_parallel_sizes=\[3, 3\] multiply to 9, but context_parallel_size=4; choose sizes "
     r"whose product is 4, e.g. \[2, 2\]"),
    (dict(cp_comm_type="a2a", num_attention_heads=6, num_query_groups=6), None,
     r"query heads per TP rank, num_attention_heads/tensor_model_parallel_size=6 is not divisible by the "
     r"all-to-all degree context_parallel_size=4 \(comm='a2a'\); use a degree that divides 6, or comm='p2p'"),
    (dict(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[4, 1], num_attention_heads=12,
          num_query_groups=3), None,
     r"key/value heads per TP rank, num_query_groups/tensor_model_parallel_size=3 cannot be replicated evenly "
     r"over the all-to-all degree hierarchical_context_parallel_sizes\[0\]=4 \(comm='a2a\+p2p'\)"),
    (dict(), 1001, r"seq_length 1001 is not divisible by 2\*cp=8 for layout 'zigzag'; pad to 1008"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True), 1000,
     r"seq_length 1000 is not divisible by 2\*cp=8 for layout 'zigzag' \* tp=2 for sequence parallelism; "
     r"pad to 1008"),
])
def test_validator_names_field_value_and_fix(fields, seq, pattern):
    with pytest.raises(HCPConfigError, match=pattern):
        validate_cp_config(_config(**fields), seq)


@pytest.mark.parametrize("fields,seq", [
    (dict(cp_comm_type="a2a", tensor_model_parallel_size=2, context_parallel_size=2), 1000),
    (dict(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[4, 1], num_query_groups=2), 1000),
    (dict(cp_comm_type="p2p", hierarchical_context_parallel_sizes=[2, 2]), 8),  # sizes serve a2a+p2p layers
    (dict(cp_comm_type=["a2a+p2p", "p2p"], hierarchical_context_parallel_sizes=[2, 2]), 16),
])
def test_validator_accepts_runnable_settings(fields, seq):
    validate_cp_config(_config(**fields), seq)


def test_per_layer_list_must_have_one_entry_per_layer():
    section = SimpleNamespace(**{f: getattr(_config(), f) for f in (
        "context_parallel_size", "hierarchical_context_parallel_sizes", "tensor_model_parallel_size",
        "sequence_parallel", "num_attention_heads", "num_query_groups")}, num_layers=2,
        cp_comm_type=["p2p", "a2a", "p2p"])
    with pytest.raises(HCPConfigError, match=r"model.cp_comm_type is a per-layer list of 3 entries but "
                                             r"model.num_layers=2; give one entry per layer"):
        validate_cp_config(section, prefix="model.")


def test_recipe_prefix_names_the_recipe_key():
    with pytest.raises(HCPConfigError, match=r"model.cp_comm_type='ring'"):
        validate_cp_config(_config(cp_comm_type="ring"), prefix="model.")


def test_allgather_is_normalised_in_place_for_strings_and_lists():
    config = _config(cp_comm_type="allgather")
    normalize_cp_comm_type(config)
    assert config.cp_comm_type == "all_gather"
    config = _config(cp_comm_type=["allgather", "p2p"])
    normalize_cp_comm_type(config)
    assert config.cp_comm_type == ["all_gather", "p2p"]


def _build_errors(rank, world):
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType

    megatron_patches.apply_all(device="cpu")
    messages = {}
    init_parallel(context_parallel_size=1)
    try:  # config says CP=4, parallel_state has CP=1: must not train without CP
        HCPDotProductAttention(_config(), 1, AttnMaskType.causal, "self")
    except HCPConfigError as err:
        messages["mismatch"] = str(err)
    finally:
        parallel_state.destroy_model_parallel()
    init_parallel(context_parallel_size=2)
    try:
        try:
            HCPDotProductAttention(_config(context_parallel_size=2, window_size=(-3, 0)), 1, AttnMaskType.causal, "self")
        except HCPConfigError as err:
            messages["window"] = str(err)
        attn = HCPDotProductAttention(_config(context_parallel_size=2), 1, AttnMaskType.causal, "self")
        q = torch.zeros(4, 1, 8, 4)
        for name, kwargs in [("packed", dict(packed_seq_params=object())), ("bias", dict(attention_bias=q)),
                             ("mask", dict(attn_mask_type=AttnMaskType.arbitrary))]:
            try:
                attn(q, q, q, torch.ones(1, 1, 4, 8, dtype=torch.bool), **kwargs)
            except NotImplementedError as err:
                messages[name] = str(err)
    finally:
        parallel_state.destroy_model_parallel()
    return messages


def test_core_attention_refuses_what_it_cannot_do():
    messages = run_distributed(2, _build_errors)[0]
    assert re.search(r"context_parallel_size=4, but the context-parallel process group has 1 ranks; initialise "
                     r"parallel_state with context_parallel_size=4", messages["mismatch"])
    assert re.search(r"TransformerConfig.window_size=\(-3, 0\): left=-3 is negative; use a number of positions >= 0, "
                     r"or -1 for an unbounded left side", messages["window"])
    assert "does not support packed sequences" in messages["packed"]
    assert "does not support attention_bias" in messages["bias"]
    assert "attn_mask_type=arbitrary with an explicit attention_mask is not supported" in messages["mask"]


@pytest.mark.parametrize("backend,kernel", [("flash", "torch:flash"), ("fused", "torch:cudnn"), ("unfused", "math"),
                                            ("local", "math"), ("auto", "auto")])
def test_attention_backend_maps_onto_our_kernel_registry(backend, kernel):
    from megatron.core.transformer.enums import AttnBackend

    from mcp_context.kernels import BACKENDS
    from mcp_context.megatron.config import kernel_backend

    assert kernel_backend(_config(attention_backend=AttnBackend[backend])) == kernel in BACKENDS


def test_deterministic_mode_on_cuda_needs_the_math_kernel():
    from megatron.core.transformer.enums import AttnBackend

    from mcp_context.megatron.config import check_deterministic

    config = _config(deterministic_mode=True)
    with pytest.raises(HCPConfigError, match=r"deterministic_mode=True with attention_backend=.*auto.* \(kernel backend "
                                             r"'auto'\) on CUDA: the fused SDPA backwards .* set "
                                             r"attention_backend='unfused'"):
        check_deterministic(config, "auto", torch.device("cuda", 0))
    check_deterministic(config, "math", torch.device("cuda", 0))  # math: matmuls, fixed ring and merge order
    check_deterministic(config, "auto", torch.device("cpu"))  # holds by construction on the CPU
    check_deterministic(_config(attention_backend=AttnBackend.flash), "torch:flash", torch.device("cuda", 0))
