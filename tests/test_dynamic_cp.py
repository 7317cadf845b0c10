"""Dynamic context parallelism through megatron-core's ``hybrid_context_parallel``.

A mixed batch (1 x 512, 2 x 128, 8 x 32 tokens) goes through megatron-core's own loader
(``HybridCPDataLoaderWrapper``: gather lengths, ``BalancedCPScheduler``, reroute) and schedule
(``hybrid_context_parallel_forward_backward``, via ``forward_backward_no_pipelining``) on 8 gloo ranks
(DP x CP = 8, budget 64 tokens a rank: the 512-token document runs on all 8 ranks, the others on groups
of 1, 2 or 4), with our core attention taking each sub-sample's ``PackedSeqParams(local_cp_size,
cp_group)``. Every token's loss and every gradient (summed over the ranks, as DP x CP's all-reduce does)
match megatron-core's local attention at CP=1 on each document alone, within 1e-5 (fp32), for flat p2p
rings and for a2a+p2p over the hierarchy [2, 4] (groups of 2: all-to-all only; of 4 and 8: all-to-all
in pairs, ring outside). The core attention alone, given each sub-sample size's PackedSeqParams on 4
ranks, matches the fp64 reference for every scheme, windows, learnable sinks and MLA's head dims (which
megatron-core's own MLA layer does not let through: it asserts local_cp_size is None). The schedule's agreement, its deadlock replay and the bad inputs are tested
at 4 ranks or without processes.
"""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed

LENGTHS = [512, 128, 128] + [32] * 8  # document lengths of the global batch
BUDGET = 64  # max_seqlen_per_dp_cp_rank
# which DP rank loads which documents (indices into LENGTHS); each rank loads one packed sample
LOADS = [[0], [1, 2], [3, 4], [5, 6], [7], [8], [9], [10]]
TOL = dict(atol=1e-5, rtol=1e-5)
# (hierarchy, comm) the engines must have run: a2a+p2p over [2, 4] is all-to-all only inside a pair,
# both levels on 4 and 8 ranks; one rank alone communicates nothing
EXPECTED = {"p2p": {((1,), "p2p"), ((2,), "p2p"), ((8,), "p2p")},
            "a2a+p2p": {((1,), "p2p"), ((2,), "a2a"), ((2, 4), "a2a+p2p")}}


def _document(doc: int, n: int) -> dict:
    generator = torch.Generator().manual_seed(100 + doc)
    positions = torch.arange(n)
    return {"tokens": torch.randint(0, 64, (n,), generator=generator),
            "labels": torch.randint(0, 64, (n,), generator=generator),
            "loss_mask": (positions % 7 != 3).float(), "position_ids": positions,
            "doc_id": torch.full((n,), doc)}


def _packed_sample(docs: list[int]) -> dict:
    parts = [_document(d, LENGTHS[d]) for d in docs]
    sample = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    sample["cu_seqlens"] = torch.tensor([0] + [sum(LENGTHS[d] for d in docs[:i + 1]) for i in range(len(docs))],
                                        dtype=torch.int32)
    return sample


def _hybrid_config(comm: str, sizes):
    from tests.tiny_gpt import tiny_config

    return tiny_config(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=BUDGET, calculate_per_token_loss=True,
                       cp_comm_type=comm, hierarchical_context_parallel_sizes=sizes)


def _step(losses: list):
    """Megatron-LM's forward step for a hybrid-CP sub-sample: slice it over its group, run the model."""
    from megatron.core.utils import get_batch_on_this_hybrid_cp_rank

    def forward_step(data_iterator, model):
        sample = dict(next(data_iterator))
        local_cp_size = int(sample.pop("local_cp_size"))
        batch, params = get_batch_on_this_hybrid_cp_rank(sample, local_cp_size)
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                          packed_seq_params=params)
        losses.append((int(batch["doc_id"][0, 0]), batch["position_ids"][0].tolist(), per_token.detach()[0].tolist(),
                       local_cp_size))
        mask = batch["loss_mask"]

        def loss_func(output):
            total = (output * mask).sum()
            return total, mask.sum().to(torch.int), {"lm loss": total.detach()}

        return per_token, loss_func

    return forward_step


def _reference(model_params: dict, lengths: list[int]) -> tuple[dict, dict]:
    """megatron-core's local attention at CP=1, each document alone: per-token losses and the gradients of
    the sum of every document's masked losses."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.tiny_gpt import current_device_is_cpu, tiny_config, tiny_gpt

    with current_device_is_cpu():
        model = tiny_gpt(tiny_config(), get_gpt_layer_local_spec(normalization="RMSNorm"), seq=max(lengths))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(model_params[name])
    per_token = {}
    for doc, n in enumerate(lengths):
        d = _document(doc, n)
        loss = model(d["tokens"][None], d["position_ids"][None], None, labels=d["labels"][None])
        (loss[0] * d["loss_mask"]).sum().backward()
        per_token[doc] = loss.detach()[0]
    return per_token, {n: p.grad for n, p in model.named_parameters()}


def _against_reference(rank, world, model, losses, lengths, comm, expected_schemes, expected_sizes) -> list[str]:
    """On rank 0, after summing the gradients over the ranks: every token's loss (gathered from every
    rank's ``(doc, positions, losses, group size)``) and every gradient against the CP=1 reference, and
    the (hierarchy, comm) pairs and group sizes that ran; the mismatches, one line each."""
    for param in model.parameters():
        torch.distributed.all_reduce(param.grad)
    ran = {(g.sizes, c) for m in model.modules() if hasattr(m, "sub_sample_groups") for _, _, g, c in m._engines}
    every, schemes = [None] * world, [None] * world
    torch.distributed.all_gather_object(every, losses)
    torch.distributed.all_gather_object(schemes, ran)
    if rank:
        return []
    ran = set().union(*schemes)
    errors = [f"{comm}: ran {sorted(ran)}, not {sorted(expected_schemes - ran)}"] if expected_schemes - ran else []
    ref_loss, ref_grads = _reference({n: p.detach() for n, p in model.named_parameters()}, lengths)
    seen, sizes_used = {d: torch.zeros(lengths[d], dtype=torch.bool) for d in ref_loss}, set()
    for doc, positions, values, cp in (entry for rank_losses in every for entry in rank_losses):
        sizes_used.add(cp)
        seen[doc][positions] = True
        got, want = torch.tensor(values), ref_loss[doc][positions]
        if not torch.allclose(got, want, **TOL):
            errors.append(f"{comm}: doc {doc} on {cp} ranks: loss |diff| {(got - want).abs().max():.3g}")
    errors += [f"{comm}: doc {d} has tokens no rank computed" for d, s in seen.items() if not s.all()]
    for name, param in model.named_parameters():
        if not torch.allclose(param.grad, ref_grads[name], **TOL):
            errors.append(f"{comm}: grad {name} |diff| {(param.grad - ref_grads[name]).abs().max():.3g}")
    if not expected_sizes <= sizes_used:
        errors.append(f"{comm}: sub-samples ran on group sizes {sorted(sizes_used)}, not {sorted(expected_sizes)}")
    return errors


def _hybrid_parity(rank, world, variants):
    import megatron_patches
    from megatron.core import parallel_state
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mcp_context.megatron.dynamic_schedule import agreed_hybrid_cp_loader
    from mcp_context.megatron.specs import hcp_local_spec
    from tests.tiny_gpt import init_parallel, tiny_gpt

    megatron_patches.apply_all(device="cpu")
    init_parallel(hybrid_context_parallel=True)
    errors = []
    try:
        for comm, sizes in variants:
            torch.manual_seed(0)
            config = _hybrid_config(comm, sizes)
            model = tiny_gpt(config, hcp_local_spec, seq=max(LENGTHS))
            loader = agreed_hybrid_cp_loader(HybridCPDataLoaderWrapper(iter([[_packed_sample(LOADS[rank])]]), config))
            losses: list = []
            get_forward_backward_func()(forward_step_func=_step(losses), data_iterator=loader, model=[model],
                                        num_microbatches=1, seq_length=max(LENGTHS), micro_batch_size=1)
            errors += _against_reference(rank, world, model, losses, LENGTHS, comm, EXPECTED[comm], {1, 2, 8})
    finally:
        parallel_state.destroy_model_parallel()
    return errors


def test_megatron_hybrid_cp_schedule_matches_cp1_losses_and_gradients():
    """megatron-core's full hybrid-CP schedule on 8 ranks with our attention = CP=1, per token and per gradient."""
    errors = run_distributed(8, _hybrid_parity, [("p2p", None), ("a2a+p2p", [2, 4])])[0]
    assert not errors, "\n".join(errors)


# ---- the rules, without processes ----

def test_a_sub_group_runs_the_hierarchy_cut_from_level0():
    from mcp_context.cp_rules import dynamic_cp_levels

    assert dynamic_cp_levels(1, 8, 2, "a2a+p2p") == ((1,), "p2p")
    assert dynamic_cp_levels(2, 8, 2, "a2a+p2p") == ((2,), "a2a")  # inside one all-to-all domain
    assert dynamic_cp_levels(4, 8, 2, "a2a+p2p") == ((2, 2), "a2a+p2p")
    assert dynamic_cp_levels(8, 8, 2, "a2a+p2p") == ((2, 4), "a2a+p2p")
    assert dynamic_cp_levels(8, 8, 4, "a2a+all_gather") == ((4, 2), "a2a+all_gather")
    assert dynamic_cp_levels(4, 8, 2, "allgather") == ((4,), "all_gather")
    assert dynamic_cp_levels(4, 8, 8, "p2p") == ((4,), "p2p")
    with pytest.raises(ValueError, match=r"local_cp_size=3 does not divide the 8 data x context parallel ranks; "
                                         r"a sub-sample's group must be one of \[1, 2, 4, 8\]"):
        dynamic_cp_levels(3, 8, 2, "p2p")
    with pytest.raises(ValueError, match=r"local_cp_size=6 ranks cannot be cut into all-to-all domains of "
                                         r"hierarchical_context_parallel_sizes\[0\]=4"):
        dynamic_cp_levels(6, 12, 4, "a2a+p2p")


def test_cp_size_needed_is_megatron_cores_gpus_needed():
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    from mcp_context.cp_rules import cp_size_needed

    scheduler = object.__new__(BalancedCPScheduler)  # gpus_needed reads only the budget
    scheduler.max_seq_len_per_rank = BUDGET
    for length in (1, 63, 64, 65, 128, 129, 512, 513, 4096):
        assert cp_size_needed(length, BUDGET) == scheduler.gpus_needed(length), length


def test_a_sub_sample_longer_than_the_budget_times_the_world_names_the_fix():
    from mcp_context.cp_rules import check_sub_sample_fits

    check_sub_sample_fits(512, 64, 8)
    with pytest.raises(ValueError, match=r"sub-sample of 600 tokens needs 16 ranks at max_seqlen_per_dp_cp_rank=64, "
                                         r"but the data x context parallel group has 8; raise "
                                         r"max_seqlen_per_dp_cp_rank to at least 75"):
        check_sub_sample_fits(600, 64, 8)
    with pytest.raises(ValueError, match=r"max_seqlen_per_dp_cp_rank=None must be a positive integer"):
        check_sub_sample_fits(600, None, 8)


def test_a_schedule_whose_ranks_meet_in_crossed_order_is_a_named_deadlock():
    from mcp_context.megatron.dynamic_schedule import check_runs_in_order

    check_runs_in_order([[[0, 2], [0, 3], [1], [1]], [[4], [4], [4], [4]]])  # group 0, then all four
    with pytest.raises(ValueError, match=r"deadlocks: rank 0 waits in group 0 for sub-sample 0 with ranks \[0, 1\]; "
                                         r"rank 1 waits in group 0 for sub-sample 1 with ranks \[0, 1\]"):
        check_runs_in_order([[[0, 1], [1, 0]]])


@pytest.mark.parametrize("fields, message", [
    (dict(context_parallel_size=2), r"hybrid_context_parallel=True with context_parallel_size=2: .* set "
                                    r"context_parallel_size=1"),
    (dict(max_seqlen_per_dp_cp_rank=None), r"needs max_seqlen_per_dp_cp_rank, .* \(got None\)"),
    (dict(calculate_per_token_loss=False), r"needs calculate_per_token_loss=True"),
    (dict(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=None),
     r"cp_comm_type='a2a\+p2p' needs hierarchical_context_parallel_sizes with at least 2 levels"),
])
def test_hybrid_config_refusals_name_the_field(fields, message):
    from mcp_context.megatron import HCPConfigError
    from mcp_context.megatron.config import validate_cp_config
    from tests.tiny_gpt import tiny_config

    base = dict(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=BUDGET, calculate_per_token_loss=True)
    with pytest.raises(HCPConfigError, match=message):
        validate_cp_config(tiny_config(**{**base, **fields}))


# ---- agreement and bad sub-samples on 4 ranks ----

def _error(fn) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return "no error"


def _agreement_and_bad_inputs(rank, world):
    import megatron_patches
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    from megatron.core.transformer.enums import AttnMaskType

    from mcp_context.megatron.core_attention import HCPDotProductAttention
    from mcp_context.megatron.dynamic_schedule import AgreedScheduler, agree_on_schedule
    from tests.tiny_gpt import init_parallel

    megatron_patches.apply_all(device="cpu")
    out = {}
    # sub-samples 0..3: 0 on all four ranks, then 1 on ranks 0-1, 2 on rank 2, 3 on rank 3; rank 2 plants sub-sample
    # 1 on ranks 2-3 instead
    lengths = {0: 256, 1: 128, 2: 32, 3: 32}
    schedule = [[[0], [0], [0], [0]], [[1], [1], [2], [3]]]
    planted = [[[0], [0], [0], [0]], [[1], [1], [1, 2], [1, 3]]] if rank == 2 else schedule
    agree_on_schedule(schedule, lengths, torch.distributed.group.WORLD)  # agreed: passes on every rank
    out["planted"] = _error(lambda: agree_on_schedule(planted, lengths, torch.distributed.group.WORLD))
    scheduler = AgreedScheduler(BalancedCPScheduler(64, torch.distributed.group.WORLD), torch.distributed.group.WORLD, 64)
    out["too long"] = _error(lambda: scheduler.get_groups_and_subsamples([(0, 32), (1, 257)], None))

    init_parallel(hybrid_context_parallel=True)
    try:
        from tests.tiny_gpt import tiny_config

        config = tiny_config(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=64, calculate_per_token_loss=True)
        attention = HCPDotProductAttention(config, 1, AttnMaskType.causal, "self")
        pair = parallel_state.get_hybrid_data_context_parallel_groups(group_size=2)
        three = torch.distributed.new_group([0, 1, 2])
        q = torch.randn(16, 1, 4, 8)
        kv = torch.randn(16, 1, 2, 8)

        def call(**params):
            return attention(q, kv, kv, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", **params))

        out["size differs"] = _error(lambda: call(local_cp_size=4, cp_group=pair, max_seqlen_q=64))
        out["no group"] = _error(lambda: call(local_cp_size=2, max_seqlen_q=32))
        if rank < 3:
            out["not a divisor"] = _error(lambda: call(local_cp_size=3, cp_group=three, max_seqlen_q=48))
        out["wrong length"] = _error(lambda: call(local_cp_size=2, cp_group=pair, max_seqlen_q=64))
        out["thd"] = _error(lambda: attention(q, kv, kv, None, packed_seq_params=PackedSeqParams(
            qkv_format="thd", local_cp_size=2, cp_group=pair)))
        fixed = HCPDotProductAttention(tiny_config(), 1, AttnMaskType.causal, "self")
        out["heads"] = _error(lambda: HCPDotProductAttention(tiny_config(
            hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=64, calculate_per_token_loss=True,
            num_attention_heads=2, num_query_groups=2, cp_comm_type="a2a"), 1, AttnMaskType.causal, "self"))
        out["not hybrid"] = _error(lambda: fixed(q, kv, kv, None, packed_seq_params=PackedSeqParams(
            qkv_format="sbhd", local_cp_size=2, cp_group=pair)))
    finally:
        parallel_state.destroy_model_parallel()
    return out


def test_planted_schedule_mismatch_and_bad_sub_samples_raise_naming_the_value():
    """Every rank raises (no hang): a rank whose schedule differs, a sub-sample no group can hold, and
    PackedSeqParams whose group, size or length do not fit, each named with its fix."""
    results = run_distributed(4, _agreement_and_bad_inputs)
    for rank, out in enumerate(results):
        assert out["planted"].startswith("ranks [2] disagree with the other ranks on the dynamic-CP schedule at its "
                                         "sub-sample #1 (the others: sub-sample 1 (128 tokens) in group 1 on ranks [0, 1]; "
                                         "rank 2: sub-sample 1 (128 tokens) in group 1 on ranks [0, 1, 2, 3])"), out["planted"]
        assert out["too long"].startswith("sub-sample 1 of 257 tokens needs 8 ranks at max_seqlen_per_dp_cp_rank=64, "
                                          "but the data x context parallel group has 4; raise "
                                          "max_seqlen_per_dp_cp_rank to at least 65"), out["too long"]
        assert "cp_group has 2 ranks but local_cp_size=4; pass the group of local_cp_size ranks" in out["size differs"]
        assert "local_cp_size=2 without a cp_group: pass the group of those 2 ranks" in out["no group"]
        if rank < 3:
            assert "local_cp_size=3 does not divide the 4 data x context parallel ranks" in out["not a divisor"]
        assert ("max_seqlen_q=64, but this rank holds 16 tokens of a sub-sample shared by 2 ranks (32 in all"
                in out["wrong length"]), out["wrong length"]
        assert "qkv_format='thd' with a per-sub-sample cp_group" in out["thd"]
        assert ("hybrid_context_parallel with cp_comm_type='a2a': query heads per TP rank=2 is not divisible by the "
                "all-to-all degree the data x context parallel size=4" in out["heads"]), out["heads"]
        assert (f"packed_seq_params carries local_cp_size=2 / a cp_group of ranks {[rank // 2 * 2, rank // 2 * 2 + 1]} "
                f"other than the CP group [{rank}], but TransformerConfig.hybrid_context_parallel=False; set "
                f"hybrid_context_parallel=True" in out["not hybrid"]), out["not hybrid"]


# ---- every scheme, window, sinks and MLA's head dims, per sub-sample size, against the fp64 reference ----

ATTENTION_VARIANTS = [  # (cp_comm_type, hierarchical_context_parallel_sizes, other config fields, (dk, dv))
    ("p2p", None, (), (8, 8)),
    ("a2a", None, (), (8, 8)),
    ("all_gather", None, (("window_size", (5, 0)),), (8, 8)),
    ("a2a+p2p", [2, 2], (("softmax_type", "learnable"),), (8, 8)),
    ("a2a+all_gather", [2, 2], (("window_size", (3, 0)), ("softmax_type", "learnable")), (12, 6)),  # MLA's dv != dk
]


def _sub_samples_match_reference(rank, world, variants, seq):
    import megatron_patches
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from mcp_context import shard_sequence
    from mcp_context.megatron.core_attention import HCPDotProductAttention
    from tests.reference import full_attention, random_qkv
    from tests.tiny_gpt import init_parallel, tiny_config

    megatron_patches.apply_all(device="cpu")
    init_parallel(hybrid_context_parallel=True)
    errors = []
    try:
        for comm, sizes, fields, (dk, dv) in variants:
            config = tiny_config(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=seq // world,
                                 calculate_per_token_loss=True, cp_comm_type=comm,
                                 hierarchical_context_parallel_sizes=sizes, **dict(fields))
            torch.manual_seed(0)
            attention = HCPDotProductAttention(config, 1, AttnMaskType.causal, "self", k_channels=dk, v_channels=dv)
            for n in (1, 2, world):
                group = None if n == 1 else parallel_state.get_hybrid_data_context_parallel_groups(group_size=n)
                cp_rank = rank % n
                q, k, v, dout = random_qkv(seq, 1, 4, 2, dk, seed=rank // n, v_head_dim=dv)  # one sub-sample per group
                sink = attention.softmax_offset
                ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
                ref_sink = sink.detach().double().requires_grad_() if sink is not None else None
                ref_out, _ = full_attention(*ref_inputs, True, dk ** -0.5, window=config.window_size or (-1, -1),
                                            sink=ref_sink)
                (ref_out * dout).sum().backward()
                local = [shard_sequence(x, n, cp_rank).float().requires_grad_() for x in (q, k, v)]
                if sink is not None:
                    sink.grad = None
                out = attention(*local, None, packed_seq_params=PackedSeqParams(
                    qkv_format="sbhd", local_cp_size=n, cp_group=group, max_seqlen_q=seq))
                (out.view(*out.shape[:2], 4, dv) * shard_sequence(dout, n, cp_rank).float()).sum().backward()
                where = f"{comm} {dict(fields)} dk={dk} dv={dv} on {n} ranks"
                checks = [("out", out.view(*out.shape[:2], 4, dv), ref_out.detach())] + [
                    (f"d{name}", x.grad, ref.grad) for name, x, ref in zip("qkv", local, ref_inputs)]
                checks = [(name, got, shard_sequence(want, n, cp_rank)) for name, got, want in checks]
                if sink is not None:
                    if group is not None:
                        torch.distributed.all_reduce(sink.grad, group=group)
                    checks.append(("dsink", sink.grad, ref_sink.grad))
                for name, got, want in checks:
                    if not torch.allclose(got.double(), want, **TOL):
                        errors.append(f"{where}: {name} |diff| {(got.double() - want).abs().max():.3g}")
    finally:
        parallel_state.destroy_model_parallel()
    return errors


def test_each_sub_sample_size_matches_the_reference_for_every_scheme_window_sinks_and_mla_dims():
    """The core attention given PackedSeqParams(local_cp_size, cp_group) on 4 ranks (groups of 1, 2, 4), each
    group its own sub-sample: output and dq, dk, dv (and the sinks' gradient summed over the group)
    within 1e-5 of the fp64 reference, fp32."""
    errors = run_distributed(4, _sub_samples_match_reference, ATTENTION_VARIANTS, 32)
    assert not any(errors), "\n".join(e for rank_errors in errors for e in rank_errors)


# ---- our own plan (any divisor the hierarchy can cut), its start-up groups and the step runner ----

OWN_LENGTHS = [64, 48, 32, 24, 16, 8, 8]  # at 16 tokens a rank over 4 ranks: groups of 4, 4, 2, 2, 1, 1, 1


def test_own_plan_takes_the_smallest_group_that_fits_any_divisor_and_cannot_deadlock():
    from mcp_context.cp_rules import dynamic_cp_sizes
    from mcp_context.megatron.dynamic_plan import plan_sub_samples
    from mcp_context.megatron.dynamic_schedule import check_runs_in_order

    assert dynamic_cp_sizes(12, 4) == [1, 2, 4, 12]  # 3 and 6 would straddle all-to-all domains of 4
    assert dynamic_cp_sizes(6, 6) == [1, 2, 3, 6]
    plan = plan_sub_samples([40, 20, 10, 10, 5], 10, dynamic_cp_sizes(6, 6), 6)
    groups = {sid: [r for r, ids in enumerate(plan[0]) if sid in ids] for sid in range(5)}
    assert groups == {0: [0, 1, 2, 3, 4, 5], 1: [0, 1], 2: [2], 3: [3], 4: [4]}, groups  # 40 -> 6 (no 4), 20 -> 2
    check_runs_in_order(plan)
    plan = plan_sub_samples(OWN_LENGTHS, 16, [1, 2, 4], 4)
    # work ~ length² / ranks: 32 on ranks 0-1, 24 on the lighter 2-3, the short ones on the lightest rank each
    assert plan == [[[0, 1, 2], [0, 1, 2], [0, 1, 3, 4], [0, 1, 3, 5, 6]]], plan
    with pytest.raises(ValueError, match=r"sub-sample 0 of 65 tokens does not fit 4 ranks at budget=16 \(64 tokens "
                                         r"at most\); raise budget to at least 17"):
        plan_sub_samples([65], 16, [1, 2, 4], 4)


def _own_plan_parity(rank, world, comm, sizes):
    import megatron_patches
    from megatron.core import parallel_state

    from mcp_context.cp_rules import dynamic_cp_sizes
    from mcp_context.megatron.dynamic_groups import build_sub_groups
    from mcp_context.megatron.specs import hcp_local_spec
    from mcp_context.pretrain.dynamic import agreed_plan, run_plan
    from tests.tiny_gpt import init_parallel, tiny_gpt

    megatron_patches.apply_all(device="cpu")
    init_parallel()
    try:
        world_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        allowed = dynamic_cp_sizes(world, sizes[0] if sizes else world)
        groups = build_sub_groups(world_group, allowed)
        torch.manual_seed(0)
        model = tiny_gpt(_hybrid_config(comm, sizes), hcp_local_spec, seq=max(OWN_LENGTHS))
        plan = agreed_plan(OWN_LENGTHS, 16, allowed, world_group)
        documents = [_document(doc, n) for doc, n in enumerate(OWN_LENGTHS)]
        _, _, left = run_plan(model, documents, plan, groups, world_group)
        losses = [(x.doc, x.positions.tolist(), x.per_token.tolist(), x.group_size) for x in left]
        expected = {"p2p": {((1,), "p2p"), ((2,), "p2p"), ((4,), "p2p")},
                    "a2a+p2p": {((1,), "p2p"), ((2,), "a2a"), ((2, 2), "a2a+p2p")}}[comm]
        return _against_reference(rank, world, model, losses, OWN_LENGTHS, comm, expected, {1, 2, 4})
    finally:
        parallel_state.destroy_model_parallel()


def test_own_plan_on_start_up_groups_matches_cp1_losses_and_gradients():
    """Our plan, groups built once, the step runner on 4 ranks (a2a+p2p over [2, 2]) = CP=1, per token and gradient."""
    errors = run_distributed(4, _own_plan_parity, "a2a+p2p", [2, 2])[0]
    assert not errors, "\n".join(errors)


def test_hybrid_cp_cpu_patch_probes_see_cuda_in_megatron_cores_code():
    """Each function ``megatron_patches.hybrid_cp_on_cpu`` wraps still places tensors on CUDA in megatron-core's
    own code (read from the kept original: this process applies no patch)."""
    from megatron_patches._patching import original_of
    from megatron_patches.hybrid_cp_on_cpu import _names_cuda, _shims

    for owner, name, _ in _shims():
        assert _names_cuda(original_of(owner, name)), name
