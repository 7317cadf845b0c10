"""DeepSeek-V3's routing as released (sigmoid scores, the expert bias for the choice only, the best
``topk_group`` of ``n_group`` groups, the top-k renormalised and scaled): megatron-core's router function, with
the fields the converter maps, chooses transformers' experts with transformers' weights.

transformers scores a group by the sum of its top 2 experts; megatron-core's ``group_limited_topk`` by the sum of
its top ``topk // group_topk``. They agree where that is 2 (DeepSeek-V3: 8 // 4), which is why the converter refuses
another ratio naming ``topk_group``; the last test shows the two choosing differently there. Reference:
transformers' ``DeepseekV3TopkRouter``; weights within 1e-6 (fp32), the chosen experts exactly.
"""
from __future__ import annotations

import pytest
import torch

from mcp_context.convert.model_config import hf_model_from_config

transformers = pytest.importorskip("transformers", reason="transformers' DeepSeek-V3 router is the reference")

TOKENS, HIDDEN = 256, 32
SIZES = dict(hidden_size=HIDDEN, num_hidden_layers=1, first_k_dense_replace=0)  # one MoE layer
RELEASED_ROUTING = dict(n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True,
                        routed_scaling_factor=2.5)


def _routes(**routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(HF routing map, HF weights, megatron-core routing map, megatron-core weights), each ``[tokens, experts]``,
    for random hidden states, router weights and expert bias, megatron-core's fed the converted fields."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(**SIZES, **routing)
    shape = hf_model_from_config(config.to_dict()).shape
    generator = torch.Generator().manual_seed(0)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=generator) * 0.1)
        hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
        logits, weights, indices = router(hidden)
    experts = shape.num_moe_experts
    theirs_map = torch.zeros(TOKENS, experts, dtype=torch.bool).scatter_(1, indices, True)
    theirs = torch.zeros(TOKENS, experts).scatter_(1, indices, weights)
    probs, ours_map = topk_routing_with_score_function(
        logits, shape.moe_router_topk, use_pre_softmax=shape.moe_router_pre_softmax,
        num_groups=shape.moe_router_num_groups, group_topk=shape.moe_router_group_topk,
        scaling_factor=shape.moe_router_topk_scaling_factor, score_function=shape.moe_router_score_function,
        expert_bias=router.e_score_correction_bias)
    return theirs_map, theirs, ours_map, probs


def test_released_group_limited_routing_picks_transformers_experts_and_weights():
    theirs_map, theirs, ours_map, ours = _routes(**RELEASED_ROUTING)
    assert torch.equal(ours_map, theirs_map)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    # the group limit matters on these scores: without it the top 8 leave the chosen 4 groups
    theirs_free, _, ours_free, _ = _routes(**{**RELEASED_ROUTING, "n_group": 1, "topk_group": 1})
    assert torch.equal(ours_free, theirs_free) and not torch.equal(theirs_free, theirs_map)


def test_a_group_score_of_other_than_the_top_two_is_why_another_ratio_is_refused():
    """At topk 8 of the best 2 groups megatron-core would score a group by its top 4 experts: the converter
    refuses it, naming topk_group, rather than route other experts than transformers does."""
    from mcp_context.convert.model_config import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError, match=r"config.json field topk_group=2: transformers scores a "
                                                           r"group by its top 2 experts, megatron-core by its top "
                                                           r"num_experts_per_tok // topk_group = 4"):
        hf_model_from_config(transformers.DeepseekV3Config(**SIZES,
                                                           **{**RELEASED_ROUTING, "topk_group": 2}).to_dict())
