"""The training loop: build, (resume,) loop over steps, log, evaluate, checkpoint.

``train(cfg, run_dir)`` is the whole run on every rank; ``train_step`` is one optimizer step:
forward/backward of this rank's micro-batches (each cut to this CP rank's zigzag shard; with
``data.reset_attention_mask`` packed as documents first, see ``packing``), then
megatron-core's ``finalize_model_grads`` sums the gradients over the DP x CP ranks and divides them
by the global number of valid tokens (per-token loss), then the optimizer clips and steps and the
scheduler moves the learning rate. The reported loss is the mean over every valid token of the
global batch, the same number on every rank, so it does not depend on the CP or DP size.

A step whose loss or gradient norm is not finite stops the run (``TrainingDiverged``, on every rank)
before its record or any checkpoint is written, and no checkpoint is saved with non-finite weights.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from mcp_context.cp_rules import document_multiple
from mcp_context.pretrain import build
from mcp_context.pretrain.batches import MicroBatchSampler, step_batches
from mcp_context.pretrain.dynamic import DynamicCP, start_dynamic_cp, step_loss_sums
from mcp_context.pretrain.checkpoint import (checkpoint_to_resume, load_checkpoint, load_pretrained_weights,
                                             remove_interrupted_saves, remove_run_history, save_checkpoint)
from mcp_context.pretrain.launch import METRICS_FILENAME
from mcp_context.pretrain.metrics import MetricsLog, read_metrics_lines
from mcp_context.pretrain.packing import POSITIONS, DocumentPacking, packed_seq_params
from mcp_context.recipes import RecipeConfig, save_recipe


@dataclass
class TrainResult:
    """What a finished ``train`` call leaves behind (the same on every rank)."""

    run_dir: Path
    metrics_path: Path
    first_step: int
    """Step the run started from (0, or the step of the checkpoint it resumed)."""
    records: list
    """This call's per-step records (what metrics.jsonl got)."""
    checkpoint: Optional[Path]
    """The newest complete checkpoint (None when checkpoint.save is null)."""


class TrainingDiverged(FloatingPointError):
    """A step's loss or gradient norm, or the weights about to be saved, are not finite; raised on every rank."""


def _forward_loss_sum(model, micro_batch: dict, cp_group, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the per-token losses over this CP rank's valid tokens of ``micro_batch``, and their count.

    A packed micro-batch (``packing.DocumentPacking``: ``cu_seqlens`` present) is sliced per document and
    runs with megatron-core's ``PackedSeqParams`` (thd), so no token attends across a document boundary."""
    from mcp_context.megatron import slice_batch_for_cp

    micro_batch = {key: value.to(device, non_blocking=True) for key, value in micro_batch.items()}
    params, positions = None, "position_ids"
    if "cu_seqlens" in micro_batch:
        params = packed_seq_params(micro_batch.pop("cu_seqlens"), micro_batch.pop("cu_seqlens_padded"), cp_group)
        positions = POSITIONS
    local = slice_batch_for_cp(micro_batch, cp_group, params)
    per_token = model(local["tokens"], local[positions], local.get("attention_mask"), labels=local["labels"],
                      packed_seq_params=params)
    mask = local["loss_mask"].float()
    return (per_token.float() * mask).sum(), mask.sum()


def _loss_sums(model, micro_batches: list[dict], device: torch.device, dynamic: Optional[DynamicCP],
               backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's loss sum and valid tokens over ``micro_batches`` (forward, and backward with ``backward``): each
    micro-batch over the fixed CP group, or, with ``dynamic``, the step's documents over
    the groups of their plan."""
    from megatron.core import parallel_state

    if dynamic is not None:
        return step_loss_sums(model, micro_batches, dynamic, device, backward)
    cp_group = parallel_state.get_context_parallel_group()
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    num_tokens = torch.zeros((), dtype=torch.float32, device=device)
    for micro_batch in micro_batches:
        local_sum, local_tokens = _forward_loss_sum(model, micro_batch, cp_group, device)
        if backward:
            local_sum.backward()  # per-token loss: divided by the global token count in finalize_model_grads
        loss_sum += local_sum.detach()
        num_tokens += local_tokens
    return loss_sum, num_tokens


def train_step(model, optimizer, scheduler, micro_batches: list[dict], device: torch.device,
               dynamic: Optional[DynamicCP] = None) -> dict:
    """One optimizer step on this rank's micro-batches (under ``dynamic``: the whole global batch); returns
    loss, lr and grad norm (same on every rank)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss_sum, num_tokens = _loss_sums(model, micro_batches, device, dynamic, backward=True)
    finalize_model_grads([model], num_tokens=num_tokens)  # all-reduces num_tokens over DP x CP in place
    dist.all_reduce(loss_sum, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    lr = optimizer.param_groups[0]["lr"]
    success, grad_norm, _ = optimizer.step()
    if not success:
        raise FloatingPointError(f"the optimizer skipped the step (gradient norm {grad_norm}); "
                                 f"lower optimizer.lr or check the data")
    scheduler.step(1)
    return {"loss": (loss_sum / num_tokens.clamp(min=1)).item(), "lr": lr, "grad_norm": float(grad_norm)}


def _check_finite(record: dict, cfg: RecipeConfig, checkpoint: Optional[Path]) -> None:
    """Raise ``TrainingDiverged`` when the step's loss or gradient norm is not finite (the same on every rank)."""
    if math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]):
        return
    raise TrainingDiverged(
        f"step {record['step']}: loss {record['loss']}, gradient norm {record['grad_norm']} (learning rate "
        f"{record['lr']:g}) are not all finite; stopped before writing this step "
        f"(newest checkpoint: {checkpoint or 'none'}). Likely cause: optimizer.lr={cfg.optimizer.lr:g} is too high "
        f"for this model (lower it or lengthen train.lr_warmup_iters, and start afresh with --restart), "
        f"or bad data")


def _weights_finite(model) -> bool:
    """Whether every rank's parameters are all finite (a collective)."""
    finite = torch.tensor([all(bool(torch.isfinite(p).all()) for p in model.parameters())], dtype=torch.int32,
                          device=next(model.parameters()).device)
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


@torch.no_grad()
def evaluate(model, dataset, cfg: RecipeConfig, device: torch.device,
             dynamic: Optional[DynamicCP] = None) -> float:
    """Mean loss over every valid token of the first ``train.eval_iters`` global batches of ``dataset``
    (the same samples at every evaluation, so the numbers compare across steps and layouts)."""
    from megatron.core import parallel_state

    sampler = _sampler(cfg, 0, cfg.train.eval_iters)
    totals = torch.zeros(2, dtype=torch.float32, device=device)
    model.eval()
    try:
        for micro_batches in step_batches(dataset, sampler, cfg.data.num_workers, device.type == "cuda",
                                          _packing(cfg, dataset)):
            totals += torch.stack(_loss_sums(model, micro_batches, device, dynamic, backward=False))
    finally:
        model.train()
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return (totals[0] / totals[1].clamp(min=1)).item()


def _sampler(cfg: RecipeConfig, first_step: int, last_step: int) -> MicroBatchSampler:
    """This rank's samples: its data parallel slice, or, under dynamic CP, the whole global batch (the plan spreads
    its documents)."""
    from megatron.core import parallel_state

    whole = cfg.model.hybrid_context_parallel
    return MicroBatchSampler(first_step, last_step, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                             dp_rank=0 if whole else parallel_state.get_data_parallel_rank(),
                             dp_size=1 if whole else parallel_state.get_data_parallel_world_size())


def _packing(cfg: RecipeConfig, dataset) -> Optional[DocumentPacking]:
    """With ``data.reset_attention_mask``, each micro-batch packed as documents ending at the dataset's
    end-of-document token, each padded to a multiple of 2 * CP (megatron-core's per-document zigzag),
    times TP under sequence parallelism (every rank's rows split evenly over the TP ranks)."""
    m = cfg.model
    if not cfg.data.reset_attention_mask or m.hybrid_context_parallel:  # dynamic CP splits the documents itself
        return None
    multiple = document_multiple("zigzag", m.context_parallel_size) * (m.tensor_model_parallel_size
                                                                        if m.sequence_parallel else 1)
    return DocumentPacking(dataset.config.tokenizer.eod, multiple)


def _prepare_data(cfg: RecipeConfig):
    """Tokenizer and GPT datasets; rank 0 tokenises the corpus (once, cached), the others then reuse it."""
    from mcp_context.data import build_gpt_datasets, prepare_data

    failure = [None]
    if dist.get_rank() == 0:
        try:
            prepare_data(cfg)
        except Exception as err:
            failure[0] = err
    dist.broadcast_object_list(failure, src=0)  # so no rank waits for a rank 0 that failed
    if failure[0] is not None:
        raise failure[0]
    tokenizer, prefixes = prepare_data(cfg)
    train_ds, valid_ds = build_gpt_datasets(cfg, tokenizer, prefixes)
    return tokenizer, train_ds, valid_ds


def train(cfg: RecipeConfig, run_dir: Path, progress: bool = False, resume_from: Optional[Path] = None,
          restart: bool = False) -> TrainResult:
    """Train the recipe on every rank of the default process group (started here if needed).

    Starts from ``checkpoint.checkpoint_to_resume(cfg, resume_from, restart)``: ``resume_from``, else
    the ``latest`` of ``checkpoint.load`` or ``checkpoint.save``, else step 0; ``restart`` deletes the
    run's checkpoints and metrics first. Writes ``run_dir/recipe.yaml``, ``run_dir/metrics.jsonl``
    and checkpoints every ``checkpoint.save_interval`` steps and at the end. Call
    ``launch.check_recipe_for_training`` first. Raises ``checkpoint.CheckpointError`` (before any
    process group starts), ``metrics.MetricsFileError`` (likewise) and ``TrainingDiverged``.
    """
    from megatron.core import parallel_state

    checkpoint = checkpoint_to_resume(cfg, resume_from, restart)
    if not restart and (run_dir / METRICS_FILENAME).exists():
        read_metrics_lines(run_dir / METRICS_FILENAME)  # a malformed line fails here, on every rank alike
    device = build.train_device(cfg)
    owns_process_group = build.init_process_group(device)
    build.apply_megatron_patches(device)
    build.init_model_parallel(cfg)
    metrics = None
    try:
        tokenizer, train_ds, valid_ds = _prepare_data(cfg)
        model = build.build_model(cfg, tokenizer.vocab_size, device)
        if checkpoint is None and cfg.checkpoint.pretrained is not None:  # before the optimizer copies weights
            load_pretrained_weights(cfg.checkpoint.pretrained, model)
        optimizer, scheduler = build.build_optimizer(cfg, model)
        dynamic = start_dynamic_cp(cfg, tokenizer.eod) if cfg.model.hybrid_context_parallel else None
        rank0 = dist.get_rank() == 0
        notes = []
        if rank0:
            if restart:
                notes += [f"removed {path} (--restart)" for path in
                          remove_run_history(cfg.checkpoint.save, run_dir / METRICS_FILENAME)]
            if cfg.checkpoint.save is not None:
                notes += [f"removed {path} (a save that was interrupted)"
                          for path in remove_interrupted_saves(cfg.checkpoint.save)]
            save_recipe(cfg, run_dir)

        first_step = 0
        if checkpoint is not None:
            first_step = load_checkpoint(checkpoint, model, optimizer, scheduler, cfg)
        metrics = MetricsLog(run_dir / METRICS_FILENAME, first_step, cfg.train.steps, enabled=rank0,
                             progress=progress, refresh_interval=cfg.logging.log_interval)
        for note in notes + metrics.notes:
            metrics.note(note)
        if checkpoint is not None:
            metrics.note(f"resumed from {checkpoint} at step {first_step}")
        elif cfg.checkpoint.pretrained is not None:
            metrics.note(f"started from the weights of {cfg.checkpoint.pretrained}")

        t, c = cfg.train, cfg.checkpoint
        tokens_per_step = t.global_batch_size * cfg.model.seq_length
        records = []
        batches = step_batches(train_ds, _sampler(cfg, first_step, t.steps), cfg.data.num_workers,
                               device.type == "cuda", _packing(cfg, train_ds))
        start = time.perf_counter()
        for step, micro_batches in enumerate(batches, start=first_step + 1):  # step time includes loading
            record = {"step": step, **train_step(model, optimizer, scheduler, micro_batches, device, dynamic)}
            _check_finite(record, cfg, checkpoint)
            elapsed = time.perf_counter() - start
            record.update(tokens_per_s=tokens_per_step / elapsed, step_time_s=elapsed)
            if valid_ds is not None and t.eval_iters > 0 and step % t.eval_interval == 0:
                record["val_loss"] = evaluate(model, valid_ds, cfg, device, dynamic)
            records.append(record)
            metrics.log(record)
            if c.save is not None and (step % c.save_interval == 0 or step == t.steps):
                if not _weights_finite(model):
                    raise TrainingDiverged(
                        f"step {step}: the weights are not finite after the update (learning rate {record['lr']:g}); "
                        f"not saved (newest checkpoint: {checkpoint or 'none'}). Likely cause: "
                        f"optimizer.lr={cfg.optimizer.lr:g} is too high: lower it and start afresh with --restart")
                checkpoint = save_checkpoint(c.save, step, model, optimizer, scheduler, cfg)
            start = time.perf_counter()
        return TrainResult(run_dir, run_dir / METRICS_FILENAME, first_step, records, checkpoint)
    finally:
        if metrics is not None:
            metrics.close()
        parallel_state.destroy_model_parallel()
        if owns_process_group:
            dist.destroy_process_group()
