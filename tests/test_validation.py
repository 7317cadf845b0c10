"""Every input the engine cannot serve is refused with a message naming the value and the fix."""
import re

import torch

from tests._dist import run_distributed

CASES = {
    "sizes_product": r"hierarchical_context_parallel_sizes=\[3, 3\] multiply to 9, but context_parallel_size=4; "
                     r"choose sizes whose product is 4, e.g. \[2, 2\]",
    "sizes_type": r"hierarchical_context_parallel_sizes=\[2, 0\] must be a non-empty list of positive integers",
    "heads_a2a": r"query heads h=6 are not divisible by the all-to-all degree 4 \(comm='a2a'\)",
    "kv_heads_a2a": r"key/value heads h_kv=3 cannot be replicated evenly over the all-to-all degree 4",
    "seq_len": r"sequence length 12 is not divisible by 2\*cp=8 for layout 'zigzag'; pad to 16",
    "comm": r"comm='ring' is not a known cp_comm_type; choose one of p2p, a2a, all_gather, a2a\+p2p",
    "layout": r"layout='zig' is not known; choose one of contiguous, zigzag, striped",
    "a2a+p2p_flat": r"comm='a2a\+p2p' needs hierarchical groups of at least two levels, got "
                    r"hierarchical_context_parallel_sizes=\[4\]",
    "shape": r"q \(3, 2, 8, 4\) and k/v \(3, 2, 8, 8\) must agree in s_local, batch and head_dim",
    "kv_shape": r"k and v must have the same shape",
    "gqa": r"query heads h=8 are not a multiple of key/value heads h_kv=3",
    "dtype": r"q, k, v must share one dtype, got torch.float32, torch.float64, torch.float32; cast them first",
    "device": r"q, k, v must be on one device, got cpu, meta, cpu",
    "rank4": r"q must be \[s_local, b, heads, head_dim\] \(sbhd\), got shape \(2, 8, 4\)",
}


def _errors(rank, world):
    from mcp_context import build_hcp_groups, context_parallel_attention

    flat = build_hcp_groups([4])

    def t(s=4, h=8, d=4, dtype=torch.float32, device="cpu"):
        return torch.zeros(s, 2, h, d, dtype=dtype, device=device)

    calls = {
        "sizes_product": lambda: build_hcp_groups([3, 3]),
        "sizes_type": lambda: build_hcp_groups([2, 0]),
        "heads_a2a": lambda: context_parallel_attention(t(h=6), t(h=6), t(h=6), flat, comm="a2a"),
        "kv_heads_a2a": lambda: context_parallel_attention(t(h=12), t(h=3), t(h=3), flat, comm="a2a"),
        "seq_len": lambda: context_parallel_attention(t(s=3), t(s=3), t(s=3), flat, comm="p2p"),
        "comm": lambda: context_parallel_attention(t(), t(), t(), flat, comm="ring"),
        "layout": lambda: context_parallel_attention(t(), t(), t(), flat, layout="zig"),
        "a2a+p2p_flat": lambda: context_parallel_attention(t(), t(), t(), flat, comm="a2a+p2p"),
        "shape": lambda: context_parallel_attention(t(s=3), t(s=3, d=8), t(s=3, d=8), flat),
        "kv_shape": lambda: context_parallel_attention(t(), t(), t(h=4), flat),
        "gqa": lambda: context_parallel_attention(t(), t(h=3), t(h=3), flat),
        "dtype": lambda: context_parallel_attention(t(), t(dtype=torch.float64), t(), flat),
        "device": lambda: context_parallel_attention(t(), t(device="meta"), t(), flat),
        "rank4": lambda: context_parallel_attention(t()[0], t(), t(), flat),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = None
        except ValueError as err:
            messages[name] = str(err)
    return messages


def test_each_bad_input_is_refused_with_a_message_that_names_the_fix():
    messages = run_distributed(4, _errors)[0]
    for name, pattern in CASES.items():
        assert messages[name] is not None, f"{name}: no error raised"
        assert re.search(pattern, messages[name]), (name, messages[name])


def test_allgather_is_an_alias_of_all_gather():
    from mcp_context import normalize_comm

    assert normalize_comm("allgather") == "all_gather"
