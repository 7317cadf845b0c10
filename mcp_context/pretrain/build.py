"""Build what a training run needs from a recipe: process groups, the GPT, its optimizer and schedule.

Everything is megatron-core's own: ``parallel_state`` (gloo on CPU, NCCL on GPU), ``GPTModel`` with
our layer spec (``mcp_context.megatron.specs``), ``DistributedDataParallel`` with per-token loss
semantics (``calculate_per_token_loss=True``: gradients are summed over the DP x CP ranks and divided
by the global count of valid tokens), ``get_megatron_optimizer`` (gradient clipping included) and
``OptimizerParamScheduler``. The device is the recipe's ``train.device`` (``train_device``); on the
CPU, ``megatron_patches`` makes these run there (also on a machine that has CUDA). Owns no loop, no
data order and no files (see ``loop``, ``batches``, ``checkpoint``).
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from mcp_context.recipes import RecipeConfig, RecipeError
from mcp_context.recipes.schema import (decoder_spec, gpt_model_kwargs, set_yarn_attributes,
                                         transformer_config_class, transformer_config_kwargs)


def train_device(cfg: RecipeConfig) -> torch.device:
    """The device this rank trains on: ``train.device`` (``auto``: CUDA when available), the GPU of
    torchrun's ``LOCAL_RANK`` for ``cuda``. Raises ``RecipeError`` for ``cuda`` without CUDA, and
    when this node's ranks (``LOCAL_WORLD_SIZE``) outnumber its GPUs: each rank needs a GPU of its own."""
    choice = cfg.train.device
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RecipeError("train.device='cuda', but torch sees no CUDA device here; set train.device=cpu (or auto)")
    gpus = torch.cuda.device_count()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if max(local_ranks, local_rank + 1) > gpus:
        raise RecipeError(
            f"train.device={cfg.train.device!r} trains on CUDA, one GPU per rank, but this node launched "
            f"{local_ranks} rank(s) (torchrun --nproc-per-node) and has {gpus} GPU(s); launch with "
            f"--nproc-per-node {gpus} or fewer (and a recipe layout that fits), or set train.device=cpu")
    return torch.device("cuda", local_rank)


def init_process_group(device: torch.device) -> bool:
    """Start the default process group from torchrun's environment (NCCL on CUDA, gloo on the CPU).

    Returns False, doing nothing, when one is already initialised (a caller that owns it). Without a
    launcher (no ``WORLD_SIZE``), starts a one-rank group on a local port.
    """
    if dist.is_initialized():
        return False
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=10))
    return True


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def apply_megatron_patches(device: torch.device) -> None:
    """Apply ``megatron_patches`` for a run on ``device`` (the CPU shims when it is the CPU, and the fixes); idempotent."""
    import megatron_patches

    megatron_patches.apply_all(device=device)


def init_model_parallel(cfg: RecipeConfig) -> None:
    """megatron-core ``parallel_state`` for the recipe's TP / CP layout (DP is what is left) and seeds. Under
    ``model.hybrid_context_parallel`` the hierarchy describes the data parallel group, not a fixed CP group
    (CP = 1), so parallel_state gets none; ``dynamic.start_dynamic_cp`` makes that run's groups."""
    from megatron.core import parallel_state, tensor_parallel

    m = cfg.model
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        context_parallel_size=m.context_parallel_size,
        hierarchical_context_parallel_sizes=None if m.hybrid_context_parallel else m.hierarchical_context_parallel_sizes,
    )
    torch.manual_seed(cfg.train.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)


def transformer_config(cfg: RecipeConfig, device: torch.device):
    """``TransformerConfig`` of the recipe (``MLATransformerConfig`` with ``model.multi_latent_attention``),
    with per-token loss, the ``yarn_*`` attributes of a YaRN model and, on the CPU, CPU settings."""
    runtime = dict(calculate_per_token_loss=True)
    if device.type == "cpu":
        runtime.update(use_cpu_initialization=True, masked_softmax_fusion=False, bias_activation_fusion=False,
                       apply_rope_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False)
    config = transformer_config_class(cfg.model)(**transformer_config_kwargs(cfg.model), **runtime)
    return set_yarn_attributes(config, cfg.model)


def build_model(cfg: RecipeConfig, tokenizer_vocab_size: int, device: torch.device):
    """The recipe's ``GPTModel`` with the HCP spec of its structure (MoE, q/k norms, MLA, dense layers among
    MoE ones: ``decoder_spec``), wrapped in megatron-core DDP.

    Initialisation depends only on ``train.seed`` and TP (weights are made whole, then split over TP),
    so runs at any CP size start from the same weights.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    config = transformer_config(cfg, device)
    spec = decoder_spec(cfg.model, config)
    model = GPTModel(config, spec, **gpt_model_kwargs(cfg.model, cfg.padded_vocab_size(tokenizer_vocab_size)))
    if device.type == "cuda":
        model.cuda(device)
    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=config.bf16 or config.fp16,
        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
    )
    return DistributedDataParallel(config, ddp_config, model)


def build_optimizer(cfg: RecipeConfig, model):
    """megatron-core optimizer (Adam/SGD, grad clipping at ``optimizer.clip_grad``) and LR schedule.

    The schedule is Megatron-LM's: linear warm-up from 0 over ``train.lr_warmup_iters`` steps, then
    ``train.lr_decay_style`` down to ``optimizer.min_lr`` at ``train.lr_decay_iters`` (default
    ``train.steps``); constant weight decay.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(OptimizerConfig(**cfg.to_optimizer_config_kwargs()), [model])
    t, o = cfg.train, cfg.optimizer
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=t.lr_warmup_iters,
        lr_decay_steps=t.lr_decay_iters if t.lr_decay_iters is not None else t.steps,
        lr_decay_style=t.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=t.steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
