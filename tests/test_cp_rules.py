"""Rules stated once in ``cp_rules`` agree with megatron-core's own behaviour.

The TP heads rule: for every small (heads, query groups, TP), ``heads_per_tp_rank`` accepts exactly the
combinations megatron-core 0.16.1's ``TransformerConfig`` and ``SelfAttention`` accept, and gives the
per-rank head counts its attention computes with (``num_attention_heads_per_partition`` after the
query-group selection, ``num_query_groups_per_partition``)."""
from __future__ import annotations

import itertools
import warnings

import pytest

from mcp_context.cp_rules import document_multiple, heads_per_tp_rank


def _megatron_accepts(heads: int, groups: int, tp: int) -> bool:
    from megatron.core.transformer import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            TransformerConfig(num_layers=1, hidden_size=heads * 8, num_attention_heads=heads, num_query_groups=groups,
                              tensor_model_parallel_size=tp, use_cpu_initialization=True)
        except (ValueError, AssertionError):
            return False
    return heads % groups == 0  # megatron-core's attention reshapes query heads per group


@pytest.mark.parametrize("heads,groups,tp", [c for c in itertools.product([4, 6, 8, 12], [1, 2, 3, 4, 6], [1, 2, 3, 4])
                                             if c[0] % c[1] == 0])
def test_the_tp_heads_rule_is_megatron_cores(heads, groups, tp):
    accepted = _megatron_accepts(heads, groups, tp)
    try:
        per_rank = heads_per_tp_rank(heads, groups, tp)
    except ValueError as err:
        assert not accepted, f"refused what megatron-core builds: {err}"
        return
    assert accepted, (heads, groups, tp)
    # megatron-core: h/tp query heads per rank; groups/tp KV heads, or one when there are fewer groups than TP
    assert per_rank == (heads // tp, groups // tp if groups >= tp else 1)


def test_document_multiples_of_the_packed_layouts():
    assert document_multiple("zigzag", 4) == 8 and document_multiple("zigzag", 1) == 1
    assert document_multiple("balanced", 4) == 1
    with pytest.raises(ValueError, match="layout='bogus' is not known"):
        document_multiple("bogus", 2)
