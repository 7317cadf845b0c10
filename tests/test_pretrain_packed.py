"""The pretrain entry with ``data.reset_attention_mask=true``: every micro-batch trained as packed documents.

Documents end at the end-of-document token (megatron-core ``GPTDataset`` semantics); the samples of a
micro-batch become one packed sequence (b = 1, thd) with each document padded to a multiple of 2·CP.
The tiny recipe at CP = 4 as [2, 2] (a2a+p2p) repeats the same run at CP = 1 (DP = 4) within 1e-4
relative per step (loss, gradient norm, learning rate, validation loss), and differs from the run
without document masks (so the documents really are masked). Dynamic CP (``model.hybrid_context_parallel``:
each document on its own group of the data parallel ranks) trains the same steps as a fixed CP: over 4 ranks
as CP = 4 [2, 2], and over 8 ranks (documents on groups of 1, 2, 4 and 8) as CP = 8 [2, 4], losses and
gradients within 1e-5. The packing of a token row with EOD tokens (offsets, padding, loss mask, positions)
and the split of a global batch into documents are checked directly.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests._dist import run_distributed
from tests.test_pretrain import CP1, HCP4, REL, _assert_same_steps, _records, _train

STEPS = ["train.steps=3", "train.lr_warmup_iters=0", "train.lr_decay_iters=3", "train.eval_interval=3",
         "train.eval_iters=1"]
PACKED = ["data.reset_attention_mask=true", "data.reset_position_ids=true"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pretrain_packed_data")


def _run(data_dir, run_dir, overrides):
    return _records(run_distributed(4, _train, str(run_dir), STEPS + overrides + [f"data.cache_dir={data_dir}"],
                                    False))


@pytest.fixture(scope="module")
def packed_hcp(data_dir, tmp_path_factory):
    """The packed run at CP = 4 as [2, 2] (a2a+p2p): the reference of both parity tests."""
    return _run(data_dir, tmp_path_factory.mktemp("hcp"), PACKED + HCP4)


def test_packed_documents_at_cp4_hierarchical_match_cp1_and_differ_from_unmasked(data_dir, packed_hcp, tmp_path):
    """Parity with CP = 1 within 1e-4 relative (measured: <= 1.2e-7). Against the same samples without
    document masks (CP = 1) every gradient norm differs by more than 5e-4 relative (measured: 8e-4 to
    1.4e-2) and the losses from step 2 on, validation included, by more than 2e-4 (measured: 3.3e-4 to
    4.9e-4); step 1's loss is the same within 1e-5 (near-uniform predictions at initialisation)."""
    packed_cp1 = _run(data_dir, tmp_path / "cp1", PACKED + CP1)
    unmasked = _run(data_dir, tmp_path / "unmasked", CP1)
    assert [r["step"] for r in packed_hcp] == [1, 2, 3] and "val_loss" in packed_hcp[2]
    _assert_same_steps(packed_hcp, packed_cp1)
    assert packed_hcp[2]["loss"] < packed_hcp[0]["loss"] - 0.1  # it trains
    for rec, ref in zip(packed_hcp, unmasked):  # the same samples, seen as separate documents
        assert abs(rec["grad_norm"] / ref["grad_norm"] - 1) > 5 * REL, (rec, ref)
        for key in ("loss", "val_loss") if rec["step"] > 1 else ():
            if key in rec:
                assert abs(rec[key] / ref[key] - 1) > 2 * REL, (key, rec, ref)


def test_a_row_with_eod_tokens_packs_into_padded_documents():
    """EOD = 0, padded to multiples of 4: sample 0 holds documents [5 6 0] [7 0] [0] [8 9] (the last
    one cut by the sample's end), sample 1 one document ending at its last token; the dataset's loss
    mask (here the EOD masked, as eod_mask_loss does) and position ids are kept, padding rows are 0."""
    from mcp_context.data.documents import document_offsets
    from mcp_context.pretrain.packing import POSITIONS, DocumentPacking

    tokens = torch.tensor([[5, 6, 0, 7, 0, 0, 8, 9], [1, 2, 3, 4, 5, 6, 7, 0]])
    assert document_offsets(tokens[0], 0, 4) == ([0, 3, 5, 6, 8], [0, 4, 8, 12, 16])
    assert document_offsets(tokens[1], 0, 4) == ([0, 8], [0, 8])
    assert document_offsets(tokens[1], 0, 3) == ([0, 8], [0, 9])
    micro_batch = {"tokens": tokens, "labels": tokens + 100, "loss_mask": (tokens != 0).float(),
                   "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])}
    packed = DocumentPacking(eod=0, multiple=4)(micro_batch)
    assert packed["cu_seqlens"].dtype == packed["cu_seqlens_padded"].dtype == torch.int32
    assert packed["cu_seqlens"].tolist() == [0, 3, 5, 6, 8, 16]
    assert packed["cu_seqlens_padded"].tolist() == [0, 4, 8, 12, 16, 24]
    pad = 0
    assert packed["tokens"].tolist() == [[5, 6, 0, pad, 7, 0, pad, pad, 0, pad, pad, pad, 8, 9, pad, pad,
                                          1, 2, 3, 4, 5, 6, 7, 0]]
    assert packed["labels"].tolist() == [[105, 106, 100, 0, 107, 100, 0, 0, 100, 0, 0, 0, 108, 109, 0, 0,
                                          101, 102, 103, 104, 105, 106, 107, 100]]
    assert packed["loss_mask"].tolist() == [[1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0,
                                             1, 1, 1, 1, 1, 1, 1, 0]]
    assert packed[POSITIONS].tolist() == [[0, 1, 2, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0,
                                           0, 1, 2, 3, 4, 5, 6, 7]]
    assert "position_ids" not in packed  # slice_batch_for_cp would restart them whatever reset_position_ids says
    with pytest.raises(ValueError, match="set data.create_attention_mask=false"):
        DocumentPacking(eod=0, multiple=4)({**micro_batch, "attention_mask": torch.ones(2, 1, 8, 8, dtype=torch.bool)})


def test_packing_pads_to_2cp_times_tp_under_sequence_parallelism():
    from mcp_context.pretrain.loop import _packing
    from mcp_context.recipes import load_recipe

    dataset = SimpleNamespace(config=SimpleNamespace(tokenizer=SimpleNamespace(eod=3)))
    assert _packing(load_recipe(None, []), dataset) is None
    assert _packing(load_recipe(None, PACKED), dataset).multiple == 8
    sp = load_recipe(None, PACKED + ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"])
    assert (_packing(sp, dataset).eod, _packing(sp, dataset).multiple) == (3, 16)


def test_recipe_with_document_masks_validates_and_refuses_a_materialised_mask():
    from mcp_context.recipes import RecipeError, load_recipe, validate_recipe

    validate_recipe(load_recipe(None, PACKED))
    with pytest.raises(RecipeError, match=r"data.create_attention_mask=true would build an \[s, s\] mask per sample "
                                          r"that the packed attention cannot take: set "
                                          r"data.create_attention_mask=false"):
        validate_recipe(load_recipe(None, PACKED + ["data.create_attention_mask=true"]))


DYNAMIC = ["model.hybrid_context_parallel=true", "model.max_seqlen_per_dp_cp_rank=64", "model.context_parallel_size=1",
           "model.hierarchical_context_parallel_sizes=[2, 2]", "model.cp_comm_type=a2a+p2p"]


def _train_recording(rank, world, run_dir, overrides):
    """``_train`` (no checkpoints); the sizes of the groups the dynamic plans gave the documents, and rank 0's
    gradients of the first step (DDP's ``main_grad``: reduced over the ranks, per token; later steps' gradients
    are taken at weights that Adam's update of nearly-zero gradients already moved apart by fp32 round-off)."""
    from mcp_context.pretrain import dynamic, loop

    sizes, gradients = set(), {}
    original_plan, original_step = dynamic.run_plan, loop.train_step

    def run_plan(model, documents, plan, *args):
        sizes.update(sum(sid in ids for ids in plan[0]) for sid in range(len(documents)))
        return original_plan(model, documents, plan, *args)

    def train_step(model, *args):
        record = original_step(model, *args)
        if rank == 0 and not gradients:
            gradients.update({name: p.main_grad.detach().clone() for name, p in model.module.named_parameters()})
        return record

    dynamic.run_plan, loop.train_step = run_plan, train_step
    try:
        records, _ = _train(rank, world, run_dir, overrides, False)
        return records, sorted(sizes), gradients
    finally:
        dynamic.run_plan, loop.train_step = original_plan, original_step


def test_dynamic_cp_trains_the_same_steps_as_fixed_cp4(data_dir, packed_hcp, tmp_path):
    """``model.hybrid_context_parallel`` through ``python -m mcp_context.pretrain``'s ``train``: every rank reads
    the global batch, each document runs on the smallest group of the 4 ranks that holds it at 64 tokens a rank
    (here groups of 2, all-to-all only, and of 4, all-to-all in pairs and a ring), and the 3 steps' loss,
    gradient norm, learning rate and validation loss equal the packed run at a fixed CP = 4 [2, 2] within
    1e-5 relative, fp32 (measured: <= 1.2e-7)."""
    results = run_distributed(4, _train_recording, str(tmp_path / "dynamic"),
                              STEPS + PACKED + DYNAMIC + [f"data.cache_dir={data_dir}"])
    dynamic = _records([(records, None) for records, _, _ in results])
    # these steps' documents are 65 to 256 tokens (none fits one rank at 64); groups of 1: tests/test_dynamic_cp.py
    assert set().union(*(sizes for _, sizes, _ in results)) == {2, 4}, [sizes for _, sizes, _ in results]
    assert [r["step"] for r in dynamic] == [1, 2, 3] and "val_loss" in dynamic[2]
    for rec, ref in zip(dynamic, packed_hcp):
        for key in ("loss", "grad_norm", "lr", "val_loss"):
            if key in ref:
                assert rec[key] == pytest.approx(ref[key], rel=1e-5, abs=0), (rec["step"], key, rec[key], ref[key])


FIXED_CP8 = ["model.context_parallel_size=8", "model.hierarchical_context_parallel_sizes=[2, 4]",
             "model.cp_comm_type=a2a+p2p"]
DYNAMIC8 = ["model.hybrid_context_parallel=true", "model.max_seqlen_per_dp_cp_rank=16", "model.context_parallel_size=1",
            "model.hierarchical_context_parallel_sizes=[2, 4]", "model.cp_comm_type=a2a+p2p"]
# data.seed=10: these two steps' 16 samples hold scene ends that cut documents of 16, 32, 64, 80 and 112 tokens
# (padded), so at 16 tokens a rank every group size runs (the bundled scenes are mostly longer than a sample)
SHORT8 = ["model.seq_length=128", "train.world_size=8", "train.steps=2", "train.lr_warmup_iters=0",
          "train.lr_decay_iters=2", "train.eval_iters=0", "data.seed=10"]


def test_dynamic_cp_over_8_ranks_trains_the_same_losses_and_gradients_as_fixed_cp8(data_dir, tmp_path):
    """8 ranks, samples of 128 tokens, 2 steps: the packed run at a fixed CP = 8 as [2, 4] (a2a+p2p: all-to-all
    in pairs, a ring of 4) and dynamic CP over the 8 data parallel ranks at 16 tokens a rank (each document on
    the smallest of groups of 1, 2, 4 and 8 that holds it; pairs all-to-all only) train the same data to the same
    loss, gradient norm and learning rate at both steps within 1e-5 relative (measured: equal), and to the same
    first-step gradients (DDP's, reduced over the ranks) within 1e-5 of each tensor's largest, fp32 (measured:
    <= 2e-7)."""
    common = SHORT8 + PACKED + [f"data.cache_dir={data_dir}"]
    fixed = run_distributed(8, _train_recording, str(tmp_path / "fixed"), common + FIXED_CP8)
    dynamic = run_distributed(8, _train_recording, str(tmp_path / "dynamic"), common + DYNAMIC8)
    assert set().union(*(sizes for _, sizes, _ in dynamic)) == {1, 2, 4, 8}, [sizes for _, sizes, _ in dynamic]
    fixed_records, dynamic_records = (_records([(records, None) for records, _, _ in results])
                                      for results in (fixed, dynamic))
    assert [r["step"] for r in dynamic_records] == [r["step"] for r in fixed_records] == [1, 2]
    for rec, ref in zip(dynamic_records, fixed_records):
        for key in ("loss", "grad_norm", "lr"):
            assert rec[key] == pytest.approx(ref[key], rel=1e-5, abs=0), (rec["step"], key, rec[key], ref[key])
    got, want = dynamic[0][2], fixed[0][2]
    assert got.keys() == want.keys() and len(want) > 0
    for name, grad in want.items():
        assert float(grad.abs().max()) > 0, name  # every parameter takes part
        error = float((got[name] - grad).abs().max() / grad.abs().max())
        assert error <= 1e-5, (name, error)


def test_dynamic_cp_splits_a_global_batch_into_padded_documents():
    """EOD = 0, padded to multiples of 4: two micro-batches of one row each give the documents [5 6 0], [7 0],
    [8 9 1] (cut by the sample's end) and [1 2 3 4 5 6 7 0], in order, each padded with token, label, loss
    mask and position 0; the dataset's positions are kept."""
    from mcp_context.pretrain.dynamic import step_documents

    rows = [torch.tensor([[5, 6, 0, 7, 0, 8, 9, 1]]), torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])]
    batches = [{"tokens": t, "labels": t + 100, "loss_mask": torch.ones(1, 8), "position_ids": torch.arange(8)[None]}
               for t in rows]
    documents = step_documents(batches, eod=0, multiple=4)
    assert [d["tokens"].tolist() for d in documents] == [[5, 6, 0, 0], [7, 0, 0, 0], [8, 9, 1, 0],
                                                         [1, 2, 3, 4, 5, 6, 7, 0]]
    assert documents[0]["labels"].tolist() == [105, 106, 100, 0]
    assert documents[1]["loss_mask"].tolist() == [1, 1, 0, 0]
    assert documents[2]["position_ids"].tolist() == [5, 6, 7, 0]
