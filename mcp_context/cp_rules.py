"""The context-parallel rules, stated once: comm names, layouts, hierarchy sizes, the all-to-all degree,
which head counts an all-to-all can split, and what the sequence length must be a multiple of.

Dependency-free (no torch, nothing from this package), so every caller — the engine, the Megatron
config validator, the recipes and the planner — checks with the same rule and reports the same
message. A caller names its own fields through the ``*_name`` arguments (``"model.num_attention_heads"``
for a recipe, ``"query heads h"`` for a tensor), never by rewording the rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

@dataclass(frozen=True)
class CommRule:
    """What a ``cp_comm_type`` is, as data. ``a2a``: which CP ranks share their tokens by all-to-all
    first (``none``; ``all`` of them; ``level0``, the inner level of the hierarchy). ``kv``: how K/V
    then reach the members of the ring over the remaining ranks (``ring``: passed point-to-point, step
    by step; ``gather``: all-gathered once). ``min_levels``: hierarchy levels it needs."""

    a2a: str
    kv: str
    min_levels: int = 1
    aliases: tuple[str, ...] = ()
    summary: str = ""


COMM_SCHEMES = {
    "p2p": CommRule("none", "ring", summary="ring over all CP ranks, K/V point-to-point"),
    "a2a": CommRule("all", "ring", summary="Ulysses all-to-all over all CP ranks (a ring of one)"),
    "all_gather": CommRule("none", "gather", aliases=("allgather",),
                           summary="K/V all-gathered over all CP ranks once"),
    "a2a+p2p": CommRule("level0", "ring", min_levels=2,
                        summary="all-to-all on level 0, ring over the outer levels"),
    "a2a+all_gather": CommRule("level0", "gather", min_levels=2,
                               summary="all-to-all on level 0, K/V all-gathered over the outer levels"),
}
COMM_TYPES = tuple(COMM_SCHEMES)
COMM_ALIASES = {alias: name for name, rule in COMM_SCHEMES.items() for alias in rule.aliases}
LAYOUTS = ("contiguous", "zigzag", "striped")
PACKED_LAYOUTS = ("balanced",)  # layouts that exist only for packed sequences (cu_seqlens)
ALL_LAYOUTS = LAYOUTS + PACKED_LAYOUTS


def normalize_comm(comm: str, name: str = "comm") -> str:
    """Canonical ``cp_comm_type`` name (``allgather`` -> ``all_gather``); ValueError for unknown names."""
    canonical = canonical_comm(comm)
    if canonical not in COMM_TYPES:
        aliases = ", ".join(f"{a} = {n}" for a, n in COMM_ALIASES.items())
        raise ValueError(f"{name}={comm!r} is not a known cp_comm_type; choose one of "
                         f"{', '.join(COMM_TYPES)} (aliases: {aliases})")
    return canonical


def canonical_comm(comm):
    """``comm`` with an alias resolved (``allgather`` -> ``all_gather``); anything else unchanged, for a
    caller that reports unknown names itself."""
    return COMM_ALIASES.get(comm, comm) if isinstance(comm, str) else comm


def comm_rule(comm: str) -> CommRule:
    """The rule of a canonical or aliased comm name (ValueError for unknown names)."""
    return COMM_SCHEMES[normalize_comm(comm)]


def check_levels(comm: str, sizes, comm_name: str = "comm", sizes_name: str = "hierarchical_context_parallel_sizes",
                 fix: str = "build them with build_hcp_groups([inner, outer])") -> None:
    """A ValueError naming the fix when ``comm`` needs more hierarchy levels than ``sizes`` has (None: one
    level). Callers name their own fields (``comm_name``, ``sizes_name``) and fix."""
    need = comm_rule(comm).min_levels
    if (1 if sizes is None else len(sizes)) < need:
        flat = [c for c, r in COMM_SCHEMES.items() if r.min_levels == 1]
        raise ValueError(f"{comm_name}={normalize_comm(comm)!r} needs {sizes_name} with at least {need} levels "
                         f"(got {None if sizes is None else list(sizes)}); {fix}, or use one of {', '.join(flat)}")


def check_layout(layout: str, packed: bool = False) -> None:
    """A ValueError naming the fix for an unknown layout, or for a packed-only one without documents
    (``packed``: the sequence is packed, or its documents are checked later, per call)."""
    if layout not in ALL_LAYOUTS:
        raise ValueError(f"layout={layout!r} is not known; choose one of {', '.join(LAYOUTS)} "
                         f"(or {', '.join(PACKED_LAYOUTS)} for packed sequences)")
    if layout in PACKED_LAYOUTS and not packed:
        raise ValueError(f"layout={layout!r} places the documents of a packed sequence: pass cu_seqlens, or use "
                         f"one of {', '.join(LAYOUTS)}")


def example_hcp_sizes(cp_size: int) -> list[int]:
    """A sensible inner-first hierarchy for ``cp_size`` ranks, for error messages."""
    inner = next((d for d in (8, 4, 2) if cp_size % d == 0 and d < cp_size), cp_size)
    return [inner, cp_size // inner] if inner < cp_size else [cp_size]


def check_hcp_sizes(sizes: Sequence[int], cp_size: int, prefix: str = "") -> None:
    """Raise a ValueError that names the fix when ``sizes`` cannot describe ``cp_size`` ranks.

    ``prefix`` says where the fields live in the caller's config (``"model."`` for a recipe)."""
    sizes = list(sizes)
    if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
        raise ValueError(f"{prefix}hierarchical_context_parallel_sizes={sizes} must be a non-empty list of "
                         f"positive integers (inner level first), e.g. {example_hcp_sizes(cp_size)}")
    if math.prod(sizes) != cp_size:
        raise ValueError(f"{prefix}hierarchical_context_parallel_sizes={sizes} multiply to {math.prod(sizes)}, "
                         f"but {prefix}context_parallel_size={cp_size}; choose sizes whose product is {cp_size}, "
                         f"e.g. {example_hcp_sizes(cp_size)}")


def a2a_degree(comm: str, sizes: Sequence[int]) -> int:
    """How many adjacent CP ranks share their tokens by all-to-all before the ring (1: none), for a CP
    group of hierarchy ``sizes`` (inner first; ``[cp]`` for a flat group)."""
    return {"none": 1, "all": math.prod(sizes), "level0": sizes[0]}[comm_rule(comm).a2a]


def check_heads(h: int, h_kv: int, degree: int, comm: str, heads_name: str = "query heads h",
                kv_name: str = "key/value heads h_kv", degree_name: str = "the all-to-all degree") -> None:
    """Raise a ValueError unless ``h`` query and ``h_kv`` key/value heads split over an all-to-all of
    ``degree`` ranks (KV heads may be replicated when there are fewer of them than ranks)."""
    if h % degree:
        raise ValueError(f"{heads_name}={h} is not divisible by {degree_name}={degree} (comm={comm!r}); "
                         f"use a degree that divides {h}, or comm='p2p'")
    if h_kv >= degree and h_kv % degree:
        raise ValueError(f"{kv_name}={h_kv} is not divisible by {degree_name}={degree} (comm={comm!r}); "
                         f"use a degree that divides {h_kv}")
    if h_kv < degree and degree % h_kv:
        raise ValueError(f"{kv_name}={h_kv} cannot be replicated evenly over {degree_name}={degree} "
                         f"(comm={comm!r}); use a degree that is a multiple of {h_kv}")


def heads_per_tp_rank(heads: int, kv_heads: int, tp: int, prefix: str = "") -> tuple[int, int]:
    """Query and key/value heads one tensor-parallel rank's attention sees, by megatron-core's rule: the
    query heads split evenly over TP; the key/value heads (``num_query_groups``) split evenly too, or,
    when fewer than TP, each rank holds one (``num_query_groups`` must then divide TP). ``prefix``:
    where the fields live in the caller's config (``"model."`` for a recipe)."""
    if heads % tp:
        raise ValueError(f"{prefix}num_attention_heads={heads} is not divisible by {prefix}tensor_model_parallel_size="
                         f"{tp}; choose a TP size that divides {heads}")
    if heads % kv_heads:
        raise ValueError(f"{prefix}num_attention_heads={heads} is not divisible by {prefix}num_query_groups={kv_heads}; "
                         f"choose a number of query groups that divides the head count")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"{prefix}num_query_groups={kv_heads} must be a multiple or a divisor of "
                         f"{prefix}tensor_model_parallel_size={tp} (megatron-core's rule); choose a TP size that "
                         f"divides {kv_heads} or is a multiple of it")
    return heads // tp, max(kv_heads // tp, 1)


def document_multiple(layout: str, cp_size: int) -> int:
    """What each packed document's padded length must be a multiple of for ``layout`` over ``cp_size``
    ranks: ``2 * cp`` for the per-document zigzag (Megatron/TE thd), 1 for ``balanced`` (only the
    whole sequence is padded, to a multiple of ``cp``)."""
    check_layout(layout, packed=True)
    return 2 * cp_size if layout == "zigzag" and cp_size > 1 else 1


def seq_multiple(layout: str, cp_size: int) -> int:
    """What the global sequence length must be a multiple of for ``layout`` over ``cp_size`` ranks."""
    check_layout(layout)
    return 2 * cp_size if layout == "zigzag" and cp_size > 1 else cp_size


def check_seq_len(seq_len: int, cp_size: int, layout: str, what: str = "sequence length", tp: int = 1) -> None:
    """Raise a ValueError naming the padded length when ``seq_len`` cannot be split by ``layout`` over
    ``cp_size`` ranks (and over ``tp`` ranks of sequence parallelism when ``tp > 1``)."""
    multiple = seq_multiple(layout, cp_size)
    why = [("2*cp" if layout == "zigzag" else "cp") + f"={multiple} for layout {layout!r}"] if cp_size > 1 else []
    if tp > 1:
        multiple *= tp
        why.append(f"tp={tp} for sequence parallelism")
    if seq_len % multiple:
        raise ValueError(f"{what} {seq_len} is not divisible by {' * '.join(why)}; "
                         f"pad to {seq_len + (-seq_len % multiple)}")


# ---- dynamic context parallelism: each sub-sample's CP size from its length (megatron-core's hybrid CP) ----

def cp_size_needed(seq_len: int, budget: int) -> int:
    """megatron-core's ``BalancedCPScheduler.gpus_needed``: the smallest power of two of ranks that holds
    ``seq_len`` tokens at most ``budget`` per rank (``max_seqlen_per_dp_cp_rank``)."""
    return max(1, 2 ** math.ceil(math.log2(seq_len / budget)))


def check_sub_sample_fits(seq_len: int, budget: int, world: int, what: str = "sub-sample",
                          budget_name: str = "max_seqlen_per_dp_cp_rank") -> None:
    """A ValueError naming the fix when a ``seq_len``-token sequence needs more than the ``world`` data x
    context parallel ranks at ``budget`` tokens per rank (megatron-core's scheduler would loop forever)."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"{budget_name}={budget!r} must be a positive integer: the tokens one rank holds of a "
                         f"sub-sample (e.g. the longest sequence / the data x context parallel size)")
    if cp_size_needed(seq_len, budget) > world:
        raise ValueError(f"{what} of {seq_len} tokens needs {cp_size_needed(seq_len, budget)} ranks at "
                         f"{budget_name}={budget}, but the data x context parallel group has {world}; raise "
                         f"{budget_name} to at least {-(-seq_len // world)} (largest power-of-two group: "
                         f"{budget} x {world} = {budget * world} tokens), or split the document")


def dynamic_cp_levels(local_cp_size: int, world: int, level0: int, comm: str,
                      name: str = "packed_seq_params.local_cp_size") -> tuple[tuple[int, ...], str]:
    """The hierarchy (inner first) and comm scheme one sub-sample's group of ``local_cp_size`` ranks runs,
    out of ``world`` data x context parallel ranks whose all-to-all domain (level 0: one node) holds
    ``level0`` adjacent ranks. A group inside one domain is all-to-all only (``a2a``) for the schemes
    that all-to-all on level 0; a larger one keeps the scheme with ``level0`` ranks inside and the rest
    outside. The other schemes run over the group as it is."""
    n = local_cp_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{name}={n!r} must be a positive integer (the ranks that share one sub-sample)")
    if world % n:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"{name}={n} does not divide the {world} data x context parallel ranks; a sub-sample's "
                         f"group must be one of {fits} (megatron-core builds powers of two)")
    if n == 1:
        return (1,), "p2p"  # no communication at all
    if comm_rule(comm).a2a != "level0":
        return (n,), normalize_comm(comm)
    inner = min(n, level0)
    if n % inner:
        raise ValueError(f"{name}={n} ranks cannot be cut into all-to-all domains of "
                         f"hierarchical_context_parallel_sizes[0]={level0} adjacent ranks; use groups that are a "
                         f"multiple of {level0} or fit inside one domain, or a level-0 size that divides {n}")
    return ((n,), "a2a") if inner == n else ((inner, n // inner), normalize_comm(comm))


def dynamic_document_multiple(world: int) -> int:
    """What every document of a dynamic-CP step is padded to a multiple of: the zigzag of the largest group,
    the whole data x context parallel world (``2 * world``), whichever group the document lands on (the step
    runner, its self-test, the recipe checks and the balance report all pad so)."""
    return 2 * world


def dynamic_cp_sizes(world: int, level0: int) -> list[int]:
    """The group sizes a dynamic-CP planner may give a sub-sample over ``world`` ranks whose all-to-all
    domain holds ``level0`` adjacent ranks: every divisor of ``world`` that fits inside one domain or is
    made of whole domains (``dynamic_cp_levels`` can cut it), smallest first."""
    return [d for d in range(1, world + 1) if world % d == 0 and (level0 % d == 0 or d % level0 == 0)]


def dynamic_cp_size(seq_len: int, budget: int, sizes: Sequence[int], what: str = "sub-sample",
                    budget_name: str = "budget") -> int:
    """The smallest of ``sizes`` whose ranks hold ``seq_len`` tokens at most ``budget`` each; a ValueError
    naming the fix when even the largest cannot."""
    for size in sorted(sizes):
        if size * budget >= seq_len:
            return size
    largest = max(sizes)
    raise ValueError(f"{what} of {seq_len} tokens does not fit {largest} ranks at {budget_name}={budget} "
                     f"({largest * budget} tokens at most); raise {budget_name} to at least {-(-seq_len // largest)}, "
                     f"or split the document")
