"""The balance report's per-rank work under dynamic CP and a fixed CP size, against hand-computed figures.

One step of two samples over 8 ranks: sample 0 one document of 4096 tokens, sample 1 two of 1024 and
eight of 256. Dynamic CP at 512 tokens a rank puts the 4096 on all 8 ranks, the 1024s on ranks 0-1 and
2-3, the 256s two each on ranks 4-7; a fixed CP of 4 runs sample 0 on ranks 0-3 and sample 1 on 4-7.
A zigzag shard of a causal document of ``L`` tokens over ``n`` ranks holds ``L (L + 1) / (2 n)``
visible pairs; a p2p ring of ``n`` sends ``2 (n - 1)`` K/V blocks and ``n`` dK/dV blocks of the shard.
"""
from __future__ import annotations

import pytest
import torch

from mcp_context.plan.balance import BalanceRequest, work_balance
from mcp_context.plan.dryrun import RankShape, dry_run_rank
from mcp_context.plan.model import linear_flops_per_token, planning_shape
from mcp_context.masks import CAUSAL
from mcp_context.recipes.schema import ModelConfig

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    vocab_size=4096, gated_linear_unit=False)
LAYERS, HEADS, KV_HEADS, D = 2, 4, 2, 16
FLOPS_PER_PAIR = 2 * (D + D) * HEADS * 3.5 * LAYERS  # QK^T and PV, forward+backward, every layer
SAMPLES = ((4096,), (1024, 1024) + (256,) * 8)


def pairs(length: int, ranks: int) -> float:
    return length * (length + 1) / 2 / ranks


def p2p_bytes(length: int, ranks: int) -> int:
    """fp32 K and V of one shard per block, over every layer."""
    block = length // ranks * KV_HEADS * 2 * D * 4
    return (2 * (ranks - 1) + ranks) * block * LAYERS


@pytest.fixture(scope="module")
def balance():
    return work_balance(BalanceRequest(SAMPLES, world=8, budget=512, cp=4, model=MODEL))


def test_dynamic_cp_groups_flops_and_bytes_per_rank_match_the_hand_figures(balance):
    dynamic = balance.dynamic
    assert dynamic.group_sizes == (8, 2, 2) + (1,) * 8
    busy = pairs(4096, 8) + pairs(1024, 2)  # ranks 0-3: a share of the 4096 and of a 1024
    light = pairs(4096, 8) + 2 * pairs(256, 1)  # ranks 4-7: a share of the 4096 and two 256s
    assert dynamic.attention_flops == pytest.approx([busy * FLOPS_PER_PAIR] * 4 + [light * FLOPS_PER_PAIR] * 4,
                                                    rel=1e-12)
    assert dynamic.bytes_sent == (p2p_bytes(4096, 8) + p2p_bytes(1024, 2),) * 4 + (p2p_bytes(4096, 8),) * 4
    assert dynamic.tokens == (1024,) * 8
    spreads = dynamic.spreads()
    assert spreads["attention_flops"].ratio == pytest.approx(busy / ((busy + light) / 2), rel=1e-12)
    assert spreads["linear_flops"].ratio == 1.0


def test_fixed_cp_runs_each_sample_over_its_replicas_ranks_and_is_worse_balanced_here(balance):
    fixed = balance.fixed
    assert fixed.group_sizes == (4, 4)
    sample0 = pairs(4096, 4)
    sample1 = (2 * pairs(1024, 1) + 8 * pairs(256, 1)) / 4
    assert fixed.attention_flops == pytest.approx([sample0 * FLOPS_PER_PAIR] * 4 + [sample1 * FLOPS_PER_PAIR] * 4,
                                                  rel=1e-12)
    assert fixed.bytes_sent == (p2p_bytes(4096, 4),) * 8  # a packed sample's ring sends whole shards here
    fixed_ratio = fixed.spreads()["attention_flops"].ratio
    assert fixed_ratio == pytest.approx(sample0 / ((sample0 + sample1) / 2), rel=1e-12)  # 1.729
    assert balance.dynamic.spreads()["attention_flops"].ratio < 1.1 < 1.7 < fixed_ratio
    assert sum(balance.dynamic.attention_flops) == pytest.approx(sum(fixed.attention_flops), rel=1e-12)


def test_linear_flops_are_six_per_matmul_parameter_a_token_passes(balance):
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 2 * 64 * 128 + 2 * 64  # q and o, k and v, the MLP (no gate), 2 norms
    output = 4096 * 64 + 64  # the output layer and the final norm; the input embedding is a lookup
    assert linear_flops_per_token(planning_shape(MODEL)) == 6 * (LAYERS * per_layer + output) == 1918848
    assert balance.fixed.linear_flops == tuple(1024 * linear_flops_per_token(planning_shape(MODEL)) for _ in range(8))
    moe = BalanceRequest(((64,),), world=1, budget=64, cp=1, model=ModelConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64, num_moe_experts=4))
    assert "linear_flops" not in work_balance(moe).dynamic.spreads()


def test_a_group_inside_one_all_to_all_domain_runs_the_runners_a2a():
    """a2a+p2p with domains of 2 over 4 ranks: a 256-token document on 2 ranks runs all-to-all only."""
    req = BalanceRequest(((256, 64),), world=4, budget=128, cp=4, model=MODEL, comm="a2a+p2p", level0=2)
    dynamic = work_balance(req).dynamic
    assert dynamic.group_sizes == (2, 1)
    shape = RankShape(256, 1, HEADS, KV_HEADS, D, torch.float32)
    a2a = [dry_run_rank("a2a", (2,), "zigzag", CAUSAL, shape, r) for r in range(2)]
    assert dynamic.bytes_sent[:2] == tuple((sum(t.forward.values()) + sum(t.backward.values())) * LAYERS
                                           for t in a2a)
    assert all(set(t.forward) == {"all_to_all"} for t in a2a)
    assert dynamic.bytes_sent[2:] == (0, 0)


@pytest.mark.parametrize("changes, message", [
    ({"samples": ((4096 + 1,),), "cp": 8}, "document 0 of sample 0 (padded to a multiple of 16) of 4112 tokens does not fit 8 "
                                  "ranks at budget=512 (4096 tokens at most); raise budget to at least 514"),
    ({"cp": 3}, "cp=3 does not divide the world of 8 data x context parallel ranks; choose one of [1, 2, 4, 8]"),
    ({"cp": 2}, "the step's 2 samples do not split evenly over the 4 data parallel replicas of cp=2"),
    ({"samples": ((4096,), (1024, 0))}, "samples[1][1]=0 must be a positive number of tokens"),
    ({"budget": 0}, "budget=0 must be a positive integer"),
    ({"comm": "ring"}, "comm='ring' is not a known cp_comm_type"),
    ({"comm": "a2a+p2p", "level0": 4, "world": 12, "cp": 6},
     "cp=6 ranks cannot be cut into all-to-all domains of hierarchical_context_parallel_sizes[0]=4 adjacent ranks"),
])
def test_bad_input_is_refused_naming_the_value_and_the_fix(changes, message):
    args = dict(samples=SAMPLES, world=8, budget=512, cp=4, model=MODEL) | changes
    with pytest.raises(ValueError) as err:
        work_balance(BalanceRequest(**args))
    assert message in str(err.value)


def test_cli_refuses_a_recipe_without_a_budget_and_a_step_outside_the_run(capsys):
    from mcp_context.plan.__main__ import main

    assert main(["balance", "--recipe", "recipes/tiny_cpu.yaml"]) == 2
    assert "sets no model.max_seqlen_per_dp_cp_rank; give dynamic CP's tokens a rank with --budget" in \
        capsys.readouterr().err
    assert main(["balance", "--recipe", "recipes/tiny_dynamic_cp_cpu.yaml", "--step", "51"]) == 2
    assert "step=51 is not a step of the recipe's train.steps=50; choose one from 1 to 50" in capsys.readouterr().err


def test_the_table_and_the_json_show_each_schemes_max_mean_and_ratio(balance):
    from mcp_context.plan.report import balance_dict, balance_table

    table = balance_table(balance, "hand")
    assert table.splitlines()[0].startswith("hand: 2 samples, 11 documents, 8192 tokens; 8 data x context parallel")
    attention = next(line for line in table.splitlines() if line.startswith("attention GFLOP")).split()
    assert attention[2:] == ["3.759", "2.174", "1.729", "2.35", "2.174", "1.081"]
    assert table.endswith("fixed: 2 samples on 4 ranks; dynamic: 8 documents on 1 rank, 2 on 2 ranks, 1 on 8 ranks")
    data = balance_dict(balance)
    assert data["dynamic"]["per_rank"]["bytes_sent"] == list(balance.dynamic.bytes_sent)
    assert data["fixed"]["spread"]["bytes_sent"]["max_over_mean"] == 1.0
