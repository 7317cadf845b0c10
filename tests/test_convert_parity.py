"""Conversion tests of the numbers: the converted Megatron model gives Hugging Face's logits within
1e-4 at CP = 1 (every model of the table) and, with our HCP layer spec, at CP = 2 and CP = 4 —
sliding-window models (Mistral on every layer, Qwen2 on its upper layers) included.

The reference is ``transformers`` running the original checkpoint (fp32, eager attention). CP
shards activations, never weights: the checkpoint converted once loads unchanged at every CP size.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from mcp_context.convert.model_config import HFModel

pytest.register_assert_rewrite("tests.convert_fixtures")  # also loaded as a plugin below: rewrite it first
from tests._dist import run_distributed
from tests.convert_fixtures import (LOGIT_ATOL, MODELS, WINDOW, WINDOW_MODELS, init_megatron,
                                    tokens)

pytest.importorskip("transformers", reason="the HF side of conversion tests needs transformers")
pytest.importorskip("safetensors", reason="the independent safetensors reader/writer is the reference")
pytest_plugins = ["tests.convert_fixtures"]  # the `converted` fixture, built once a session

# CP runs use a longer sequence: its zigzag chunks hold 12 tokens at CP = 2 (a window of 8 reaches into
# the previous chunk) and 6 at CP = 4 (it spans two), and the keys a window masks fill several chunks.
SEQ_CP = 48


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_to_mcore_logits_match_hf_at_cp1(converted, name):
    hf_dir, mcore_dir, arch, reference = converted[name]
    logits, inv_freq = run_distributed(1, _case_logits_cp1, str(mcore_dir), arch, tokens())[0]
    assert logits.shape == reference.shape
    torch.testing.assert_close(logits, reference, atol=LOGIT_ATOL, rtol=0)
    from transformers import AutoModelForCausalLM

    hf_inv_freq = AutoModelForCausalLM.from_pretrained(str(hf_dir)).model.rotary_emb.inv_freq
    torch.testing.assert_close(inv_freq, hf_inv_freq.float(), atol=0, rtol=1e-6)  # RoPE (and Llama-3 scaling)


def _case_logits_cp1(rank, world_size, mcore_dir, arch, token_ids):
    from megatron.core import parallel_state

    from mcp_context.convert.verify import load_mcore_model, mcore_logits

    init_megatron()
    try:
        model = load_mcore_model(mcore_dir, HFModel.from_record(arch).shape)
        return mcore_logits(model, token_ids), model.rotary_pos_emb.inv_freq.float()
    finally:
        parallel_state.destroy_model_parallel()


def _hf_logits(hf_dir, token_ids: torch.Tensor, window: bool = True) -> torch.Tensor:
    """transformers' logits for the checkpoint in ``hf_dir``; ``window=False``: the same weights with
    every layer attending in full."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(hf_dir))
    if not window:
        config.sliding_window, config.layer_types = None, ["full_attention"] * config.num_hidden_layers
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), config=config, dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(token_ids).logits.float()


def _assert_cp_logits_match_hf(converted, name, cp, comm, sizes=None):
    """Our CP model's logits (zigzag shards, unsharded) against HF's on ``SEQ_CP`` tokens; for a window
    model, also that the window changes HF's answer, so that a CP path ignoring it would fail here."""
    from mcp_context import unshard_sequence

    hf_dir, mcore_dir, arch, _ = converted[name]
    token_ids = tokens(SEQ_CP)
    reference = _hf_logits(hf_dir, token_ids)
    if name in WINDOW_MODELS:
        assert (SEQ_CP - WINDOW) // (SEQ_CP // (2 * cp)) >= 3  # the last query's masked keys: 3+ whole chunks
        assert (_hf_logits(hf_dir, token_ids, window=False) - reference).abs().max() > 100 * LOGIT_ATOL
    shards = run_distributed(cp, _case_logits_cp, str(mcore_dir), arch, token_ids, comm, sizes)
    logits = unshard_sequence(shards, layout="zigzag", dim=1)
    torch.testing.assert_close(logits, reference, atol=LOGIT_ATOL, rtol=0)


def _case_logits_cp(rank, world_size, mcore_dir, arch, token_ids, comm, sizes):
    from megatron.core import parallel_state

    from mcp_context import shard_sequence
    from mcp_context.convert.verify import load_mcore_model
    from mcp_context.megatron.specs import get_gpt_layer_hcp_spec

    init_megatron(cp=world_size, hierarchical_context_parallel_sizes=sizes)
    try:
        cp_rank = parallel_state.get_context_parallel_rank()
        model = load_mcore_model(mcore_dir, HFModel.from_record(arch).shape,
                                 get_gpt_layer_hcp_spec(normalization="RMSNorm"), context_parallel_size=world_size,
                                 cp_comm_type=comm, hierarchical_context_parallel_sizes=sizes)
        shard = dict(cp_size=world_size, cp_rank=cp_rank, layout="zigzag", dim=1)
        local_tokens = shard_sequence(token_ids, **shard)
        positions = shard_sequence(torch.arange(token_ids.shape[1]).expand_as(token_ids), **shard)
        with torch.no_grad():
            return model(local_tokens, positions, None).float()
    finally:
        parallel_state.destroy_model_parallel()


_HCP_SPEC_MISSING = importlib.util.find_spec("mcp_context.megatron") is None or \
    importlib.util.find_spec("mcp_context.megatron.specs") is None
_NEEDS_HCP_SPEC = pytest.mark.skipif(_HCP_SPEC_MISSING, reason="mcp_context.megatron.specs (HCP layer spec, needed "
                                                               "for CP>1) is not in this tree yet")


@_NEEDS_HCP_SPEC
@pytest.mark.parametrize("name,comm", [("llama_gqa_rope3", "p2p"), ("qwen2_bias_tied", "p2p"),
                                       ("llama_gqa_rope3", "a2a"), ("mistral_window", "p2p"),
                                       ("qwen2_upper_window", "p2p")])
def test_hf_to_mcore_logits_match_hf_at_cp2(converted, name, comm):
    """CP shards activations, never weights: the checkpoint converted once loads unchanged at CP=2."""
    _assert_cp_logits_match_hf(converted, name, 2, comm)


@_NEEDS_HCP_SPEC
@pytest.mark.parametrize("comm,sizes", [("p2p", None), ("a2a+p2p", [2, 2])], ids=["p2p", "a2a+p2p-2x2"])
@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_sliding_window_models_match_hf_at_cp4(converted, name, comm, sizes):
    """The window models at CP=4, a flat ring and the two-level [2, 2] hierarchy: the window spans two
    zigzag chunks, and Qwen2's full first layer sits beside its sliding ones."""
    _assert_cp_logits_match_hf(converted, name, 4, comm, sizes)
