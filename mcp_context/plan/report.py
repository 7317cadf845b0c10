"""A plan, and a step's work balance, as a text table (for people) and as a JSON-ready dict (for tools)."""
from __future__ import annotations

import dataclasses

from .balance import Balance, RankWork
from .model import PLANNED_FIELDS
from .candidates import Candidate
from .planner import GIB, Plan, PlanRow

MIB = 2 ** 20
SKIPPED_NAMED = 8
"""The table names this many of the candidates not dry-run, the nearest first (the JSON lists all)."""


def _candidate_dict(c: Candidate) -> dict:
    return {"context_parallel_size": c.cp_size, "hierarchical_context_parallel_sizes": list(c.sizes),
            "cp_comm_type": c.comm, "layout": c.layout}


def row_dict(row: PlanRow) -> dict:
    p = row.prediction
    return {
        **_candidate_dict(row.candidate),
        "data_parallel_size": row.data_parallel_size,
        "load_balance": row.load_balance,
        "masked_waste": row.masked_waste,
        "ring_steps": row.ring_steps,
        "ring_steps_with_work": row.ring_steps_with_work,
        "bytes_per_rank": {"forward": row.forward_bytes, "backward": row.backward_bytes,
                           "by_level": row.bytes_by_level(), "intra_node": row.intra_node_bytes,
                           "inter_node": row.inter_node_bytes},
        "predicted_seconds_per_layer": {"forward": p.forward_s, "backward": p.backward_s,
                                        "forward_no_overlap": p.forward_no_overlap_s,
                                        "backward_no_overlap": p.backward_no_overlap_s, "compute": p.compute_s,
                                        "host": p.host_s},
        "attention_busy_share": p.busy,
        "replayable_from_cuda_graphs": row.replayable,
        "seconds_per_sequence_per_layer": row.seconds_per_sequence,
        "memory_bytes_per_rank": {"attention_saved": row.attention_saved_bytes,
                                  "attention_peak": row.attention_peak_bytes, "activations": row.activation_bytes,
                                  "model_state": row.model_state_bytes, "total": row.memory_bytes},
        "fits": row.fits,
        "dry_run_ranks": row.dry_run_ranks,
    }


def plan_dict(plan: Plan) -> dict:
    req = plan.request
    return {
        "request": {"model": {name: getattr(req.model, name) for name in PLANNED_FIELDS}, "seq_len": req.seq_len, "gpus": req.gpus,
                    "tensor_model_parallel_size": req.tp, "pipeline_model_parallel_size": req.pp,
                    "micro_batch_size": req.micro_batch_size, "causal": req.causal,
                    "window_size": list(req.mask.window_size), "dtype": str(req.dtype),
                    "profile": dataclasses.asdict(req.profile),
                    "cp_sizes": list(req.cp_sizes) if req.cp_sizes else "all"},
        "recommended": row_dict(plan.recommended) if plan.recommended else None,
        "reasons": plan.reasons,
        "candidates": [row_dict(r) for r in plan.rows],
        "rejected": [{"label": c.label(), "reason": why} for c, why in plan.rejected],
        "not_dry_run": [{**_candidate_dict(b.candidate), "data_parallel_size": b.data_parallel_size,
                         "attention_calls": b.calls, "host_seconds_per_layer": b.host_s,
                         "seconds_per_sequence_per_layer_at_least": b.seconds_per_sequence} for b in plan.skipped],
    }


COLUMNS = ["layout", "dp", "balance", "steps", "L0 a2a MiB", "ring MiB", "AG MiB", "inter MiB", "fwd ms", "bwd ms",
           "no-ovl ms", "host ms", "ms/seq", "attn GiB", "act GiB", "mem GiB", "fits"]


def _cells(row: PlanRow) -> list[str]:
    lv, p = row.bytes_by_level(), row.prediction
    return [row.candidate.label(), str(row.data_parallel_size), f"{row.load_balance:.3f}",
            f"{row.ring_steps_with_work}/{row.ring_steps}",
            f"{lv['level0_all_to_all'] / MIB:.0f}", f"{lv['outer_ring'] / MIB:.0f}", f"{lv['all_gather'] / MIB:.0f}",
            f"{row.inter_node_bytes / MIB:.0f}", f"{p.forward_s * 1e3:.2f}", f"{p.backward_s * 1e3:.2f}",
            f"{p.total_no_overlap_s * 1e3:.2f}", f"{p.host_s * 1e3:.2f}", f"{row.seconds_per_sequence * 1e3:.3f}",
            f"{row.attention_peak_bytes / GIB:.2f}", f"{row.activation_bytes / GIB:.1f}",
            f"{row.memory_bytes / GIB:.1f}", "yes" if row.fits else "no"]


def plan_table(plan: Plan) -> str:
    """The candidates as aligned columns, best first, then the recommendation and its reasons."""
    req = plan.request
    rows = [COLUMNS] + [_cells(r) for r in plan.rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [f"{req.model.num_layers} layers, hidden {req.model.hidden_size}, heads {req.model.num_attention_heads}/"
             f"{req.model.num_query_groups} kv, head dim {_head_dims(req.model)}; {req.seq_len} tokens, "
             f"{req.gpus} GPUs ({req.profile.gpus_per_node} a node, {req.profile.name}), TP{req.tp} PP{req.pp}"
             f"{f', CP sizes {list(req.cp_sizes)} only' if req.cp_sizes else ''}"
             f"{f', window_size {req.mask.window_size}' if req.mask.window_size not in ((-1, -1), (-1, 0)) else ''}; "
             f"per rank, per layer; MiB = forward+backward bytes sent"]
    lines += ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
              for r in rows]
    if plan.recommended is not None:
        lines.append(f"\nrecommended: {plan.recommended.candidate.label()}")
    lines += [f"  - {why}" for why in plan.reasons]
    if plan.skipped:
        named = ", ".join(f"{b.candidate.label()} {b.seconds_per_sequence * 1e3:.1f}"
                          for b in plan.skipped[:SKIPPED_NAMED])
        more = len(plan.skipped) - SKIPPED_NAMED
        lines.append(f"\n{len(plan.skipped)} layouts not dry-run, their host issue time alone too long (at least, ms "
                     f"per sequence): {named}{f', and {more} more (see --json)' if more > 0 else ''}")
    if plan.rejected:
        lines.append(f"\n{len(plan.rejected)} layouts rejected by the engine's checks (see --json for each reason)")
    return "\n".join(lines)


def _head_dims(model) -> str:
    """``128``, or ``q/k 192, v 128`` where they differ (MLA)."""
    if model.v_head_dim == model.kv_channels:
        return str(model.kv_channels)
    return f"q/k {model.kv_channels}, v {model.v_head_dim}"


def _work_dict(work: RankWork) -> dict:
    return {"per_rank": {"attention_flops": list(work.attention_flops),
                         "linear_flops": None if work.linear_flops is None else list(work.linear_flops),
                         "bytes_sent": list(work.bytes_sent), "tokens": list(work.tokens)},
            "group_sizes": list(work.group_sizes),
            "spread": {name: {"max": s.max, "mean": s.mean, "max_over_mean": s.ratio}
                       for name, s in work.spreads().items()}}


def balance_dict(balance: Balance) -> dict:
    req = balance.request
    return {"request": {"samples": [list(s) for s in req.samples], "world": req.world, "budget": req.budget,
                        "cp": req.cp, "cp_comm_type": req.comm, "level0": req.level0 or req.world,
                        "dtype": str(req.dtype), "model": {name: getattr(req.model, name) for name in PLANNED_FIELDS}},
            "fixed": _work_dict(balance.fixed), "dynamic": _work_dict(balance.dynamic)}


BALANCE_ROWS = {"attention_flops": ("attention GFLOP", 1e9), "linear_flops": ("linear GFLOP", 1e9),
                "flops": ("all GFLOP", 1e9), "bytes_sent": ("CP MiB sent", MIB)}


def _groups(sizes: tuple[int, ...], noun: str) -> str:
    """``"8 documents on 1 rank, 3 on 4 ranks"``: how many placements ran on each group size."""
    counts = sorted((n, sizes.count(n)) for n in set(sizes))
    return ", ".join(f"{c}{f' {noun}' + 's' * (c != 1) if i == 0 else ''} on {n} rank{'s' * (n != 1)}"
                     for i, (n, c) in enumerate(counts))


def balance_table(balance: Balance, title: str) -> str:
    """The fixed and the dynamic figures side by side (max, mean, max/mean per rank), then the group sizes."""
    req, docs = balance.request, sum(len(s) for s in balance.request.samples)
    fixed, dynamic = balance.fixed.spreads(), balance.dynamic.spreads()
    rows = [[f"per rank, {req.model.num_layers} layers fwd+bwd"] + ["max", "mean", "max/mean"] * 2]
    for key, (label, unit) in BALANCE_ROWS.items():
        if key in fixed:
            rows.append([label] + [cell for s in (fixed[key], dynamic[key]) for cell in (
                f"{s.max / unit:.4g}", f"{s.mean / unit:.4g}", "-" if s.ratio is None else f"{s.ratio:.3f}")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fixed_at = widths[0] + 2  # the schemes' names over their three columns
    dynamic_at = fixed_at + sum(widths[1:4]) + 6
    heading = f"fixed CP={req.cp} (DP {req.data_parallel_size})".ljust(dynamic_at - fixed_at - 1)
    lines = [f"{title}: {len(req.samples)} samples, {docs} documents, {sum(map(sum, req.samples))} tokens; "
             f"{req.world} data x context parallel ranks, {req.comm} (all-to-all domains of {req.level0 or req.world})",
             " " * fixed_at + f"{heading} dynamic ({req.budget} tokens a rank)"]
    lines += ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
              for r in rows]
    lines.append(f"\nfixed: {_groups(balance.fixed.group_sizes, 'sample')}; "
                 f"dynamic: {_groups(balance.dynamic.group_sizes, 'document')}")
    return "\n".join(lines)
