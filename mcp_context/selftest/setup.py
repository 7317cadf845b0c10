"""What a self-test checks: the CP configuration and the model's distinct attention kinds.

Built from a recipe (``--recipe R.yaml`` with dotted overrides) or from attention flags; a flag given
with a recipe overrides the recipe's value. The attention a CP group sees is one TP rank's heads
(``num_attention_heads / TP``, ``num_query_groups / TP``). A model's layers fall into at most two
kinds of mask (full causal, and the sliding window where ``window_attn_skip_freq`` leaves it on);
sinks (``softmax_type``), MLA's value head dim and packed documents (``data.reset_attention_mask`` or
``--packed``) apply to every layer, so each kind carries them.

Owns no tensors and runs nothing collective: ``Setup.fingerprint`` is what the ranks compare first.
"""
from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field, replace
from typing import Optional

import torch


SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
DEFAULT_SEQ_LEN = {"cpu": 1024, "cuda": 8192}
"""Default ``--seq-len`` per device (capped at the recipe's): the fp64 reference over the gathered
sequence runs on the test's device in query chunks of 1024 rows, a handful of fp64 ``[b, h, 1024, S]``
tensors alive at once (about ``6 * 1024 * S * b * heads * 8`` bytes): 0.4 GiB at S = 1K with 8 heads,
3 GiB at 8K, 12 GiB at 32K."""


@dataclass(frozen=True)
class AttentionKind:
    """One distinct attention of the model: its mask and what every layer adds to it."""

    window: Optional[tuple[int, int]] = None     # sliding window (left, right); None: plain causal
    softmax_type: str = "vanilla"                 # 'off-by-one': zero sinks; 'learnable': random sinks
    packed: bool = False                          # packed documents (cu_seqlens), b = 1

    @property
    def sink(self) -> bool:
        return self.softmax_type != "vanilla"

    def name(self, head_dim: int, v_head_dim: int) -> str:
        parts = ["causal" if self.window is None else f"window({self.window[0]},{self.window[1]})"]
        if self.sink:
            parts.append(f"sinks:{self.softmax_type}")
        if v_head_dim != head_dim:
            parts.append(f"mla:{head_dim}/{v_head_dim}")
        if self.packed:
            parts.append("packed")
        return "+".join(parts)


@dataclass(frozen=True)
class Setup:
    """The self-test's whole configuration (identical on every CP rank unless a fault is planted)."""

    cp_size: int
    sizes: tuple[int, ...]                        # hierarchical CP sizes (inner first); (cp_size,) if flat
    comm: str
    layout: str
    seq_len: int
    batch: int
    heads: int                                    # query heads per TP rank
    kv_heads: int
    head_dim: int
    v_head_dim: int
    kinds: tuple[AttentionKind, ...]
    dtypes: tuple[torch.dtype, ...]
    device: str = "cpu"
    seed: int = 1234
    repeats: int = 3
    source: str = "flags"                         # the recipe's name, or "flags"
    documents: tuple[tuple[int, ...], tuple[int, ...]] = field(default=((), ()))  # (cu_seqlens, padded)
    model: Optional[object] = field(default=None, compare=False)  # the recipe's ModelConfig (the layer check)
    dynamic_budget: Optional[int] = None          # dynamic CP's max_seqlen_per_dp_cp_rank; None: fixed CP only

    def kind_name(self, kind: AttentionKind) -> str:
        return kind.name(self.head_dim, self.v_head_dim)

    def fingerprint(self) -> dict:
        """What every rank must agree on before anything collective: sizes, comm, layout, packing."""
        return {"cp_size": self.cp_size, "sizes": list(self.sizes), "comm": self.comm, "layout": self.layout,
                "seq_len": self.seq_len, "batch": self.batch, "heads": [self.heads, self.kv_heads],
                "head_dims": [self.head_dim, self.v_head_dim],
                "kinds": [self.kind_name(k) for k in self.kinds], "dtypes": [str(d) for d in self.dtypes],
                "seed": self.seed, "dynamic_budget": self.dynamic_budget,
                "packing": zlib.crc32(repr(self.documents).encode()) if self.documents[0] else 0}


def document_mix(seq_len: int, multiple: int, seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(cu_seqlens, cu_seqlens_padded)`` of a realistic packed sequence of ``seq_len`` rows: one long
    document (about 40 %), a few medium ones and many short ones (lengths drawn log-uniformly), each
    padded to a multiple of ``multiple`` (2 * CP, Megatron's per-document zigzag) with a ragged end."""
    rng = random.Random(seed)
    units = seq_len // multiple
    long_units = max(1, int(units * 0.4))
    lengths = [long_units]
    left = units - long_units
    while left > 0:
        draw = max(1, min(left, int(math.exp(rng.uniform(0.0, math.log(max(2, units // 8)))))))
        lengths.append(draw)
        left -= draw
    rng.shuffle(lengths)
    cu, padded = [0], [0]
    for n in lengths:
        rows = n * multiple
        actual = max(1, rows - rng.randrange(multiple))  # the document's real length; the rest is padding
        cu.append(cu[-1] + actual)
        padded.append(padded[-1] + rows)
    return tuple(cu), tuple(padded)


def perturbed_documents(documents: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The same packing with one document boundary moved (a rank that read another packing)."""
    cu, padded = list(documents[0]), list(documents[1])
    d = 1 if len(cu) > 2 else 0
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    lengths[d] = max(1, lengths[d] - 1)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu), tuple(padded)


def model_kinds(window: Optional[tuple[int, int]], skip_freq, softmax_type: str, packed: bool
                ) -> tuple[AttentionKind, ...]:
    """The distinct attention kinds of a model: the window where layers have it, full causal where
    ``window_attn_skip_freq`` leaves layers without (or where there is no window)."""
    if softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"softmax_type={softmax_type!r} must be one of {', '.join(SOFTMAX_TYPES)}")
    if window is None or tuple(window) == (-1, -1):
        masks = [None]
    elif skip_freq is None:
        masks = [tuple(window)]
    elif isinstance(skip_freq, int):
        masks = [tuple(window)] + ([None] if skip_freq >= 1 else [])
    else:
        masks = ([tuple(window)] if any(skip_freq) else []) + ([None] if not all(skip_freq) else [])
    return tuple(AttentionKind(m, softmax_type, packed) for m in masks)


def valid_seq_len(seq_len: int, cp_size: int, layout: str, packed: bool) -> int:
    """``seq_len`` rounded down to what the layout shards evenly (2 * CP for zigzag, CP otherwise)."""
    multiple = 2 * cp_size if layout == "zigzag" or packed else cp_size
    rounded = seq_len // multiple * multiple
    if rounded < multiple * (2 if packed else 1):
        raise ValueError(f"--seq-len {seq_len} is too short for CP={cp_size} with layout {layout}: use at least "
                         f"{multiple * (2 if packed else 1)} (a multiple of {multiple})")
    return rounded


def with_documents(setup: Setup) -> Setup:
    """``setup`` with its packing drawn, when a kind is packed."""
    if not any(k.packed for k in setup.kinds):
        return setup
    return replace(setup, batch=1, documents=document_mix(setup.seq_len, 2 * setup.cp_size, setup.seed))
