"""Training checkpoints: megatron-core ``dist_checkpointing``, written under a temporary name, then pointed at.

Layout of ``checkpoint.save``::

    iter_0000010/      megatron-core torch_dist checkpoint: the model's and the optimizer's sharded
                       state (reshardable), common.pt with the scheduler, step and layout, one RNG
                       object per rank, and recipe.yaml (the resolved recipe of the run)
    latest             the name of the newest complete checkpoint ("iter_0000010")

Saving: every rank writes into ``iter_0000010.tmp``; once all have finished, rank 0 renames it to
``iter_0000010`` and only then replaces ``latest`` (temporary file + ``os.replace``). On a GPU the
tensors go through megatron-core's default ``torch_dist`` writer; without CUDA through
``InProcessTorchDistSaveStrategy``, which writes the same format from the calling process
(megatron-core's writer forks writer processes and spawns a manager process on first use: slow for
small CPU jobs, and impossible in daemonic processes such as worker pools). A crash at any
moment leaves ``latest`` naming a complete checkpoint (or no ``latest`` at all); the resumed run
deletes the crash's ``.tmp`` directories, and a save replaces a complete checkpoint that ``latest``
never named. Loading reads ``latest``. The model weights and Adam moments are stored
with their global shapes, so a run resumes at any CP size (and, for the weights, any TP size); the
per-rank RNG states are restored only when the parallel layout is unchanged.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from mcp_context.recipes import RecipeConfig, save_recipe
from mcp_context.atomic import write_atomic

LATEST_FILENAME = "latest"
TMP_SUFFIX = ".tmp"


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps (Megatron-LM's)."""
    return f"iter_{step:07d}"


def latest_checkpoint(save_dir: os.PathLike | str) -> Optional[Path]:
    """The checkpoint ``save_dir/latest`` names, or None when there is no ``latest``."""
    pointer = Path(save_dir) / LATEST_FILENAME
    if not pointer.exists():
        return None
    path = Path(save_dir) / pointer.read_text(encoding="utf-8").strip()
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path.name}, but {path} is not a complete megatron-core checkpoint; "
                                f"point {pointer} at an existing iter_* directory, or delete it to start afresh")
    return path


def remove_interrupted_saves(save_dir: os.PathLike | str) -> list[Path]:
    """Delete the ``iter_*.tmp`` directories an interrupted save left in ``save_dir``; return them.

    Call on one rank before the run saves anything (no save of this run is then in progress).
    """
    leftovers = sorted(Path(save_dir).glob(f"iter_*{TMP_SUFFIX}")) if Path(save_dir).is_dir() else []
    for path in leftovers:
        shutil.rmtree(path)
    return leftovers


def parallel_layout(cfg: RecipeConfig) -> dict:
    """What decides each rank's RNG streams: the world size and the TP / PP / CP layout."""
    m = cfg.model
    return {"world_size": dist.get_world_size(), "tensor_model_parallel_size": m.tensor_model_parallel_size,
            "pipeline_model_parallel_size": m.pipeline_model_parallel_size,
            "context_parallel_size": m.context_parallel_size,
            "hierarchical_context_parallel_sizes": m.hierarchical_context_parallel_sizes}


def _in_process_save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner, TorchDistSaveShardedStrategy,
                                                                   _replace_state_dict_keys_with_sharded_keys,
                                                                   mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        """megatron-core's ``torch_dist`` format, written by the calling process (no writer processes)."""

        def save(self, sharded_state_dict: dict, checkpoint_dir: Path) -> None:
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                                   self.keep_only_main_replica)
            dcp_save(mcore_to_pyt_state_dict(sharded_state_dict, False),
                     storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1),
                     planner=MCoreSavePlanner(flatten_state_dict=False))

    return InProcessTorchDistSaveStrategy("torch_dist", 1)


def _rng_states() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    states = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(states["torch"])
    get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def _rng_object(data: Any):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", data, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _sharded_state(model, optimizer, is_loading: bool) -> dict:
    model_state = model.module.sharded_state_dict()
    return {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading)}


def save_checkpoint(save_dir: os.PathLike | str, step: int, model, optimizer, scheduler, cfg: RecipeConfig) -> Path:
    """Save model, optimizer, scheduler, step and RNG as ``save_dir/iter_<step>``; then point ``latest`` at it.

    Collective: every rank calls it. ``model`` is the DDP-wrapped GPT of ``build.build_model``.
    """
    from megatron.core import dist_checkpointing

    save_dir = Path(save_dir)
    final = save_dir / checkpoint_name(step)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted save of this step left
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False)
    state.update(scheduler=scheduler.state_dict(), step=step, layout=parallel_layout(cfg),
                 rng_state=_rng_object(_rng_states()))
    strategy = None if torch.cuda.is_available() else _in_process_save_strategy()
    dist_checkpointing.save(state, str(tmp), sharded_strategy=strategy)
    if rank == 0:
        save_recipe(cfg, tmp)
    dist.barrier()  # every rank's files are in tmp
    if rank == 0:
        if final.exists():  # complete, but newer than `latest`: left by a run that stopped before re-pointing
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomic(save_dir / LATEST_FILENAME, final.name.encode("utf-8"))
    dist.barrier()
    return final


def load_checkpoint(path: os.PathLike | str, model, optimizer, scheduler, cfg: RecipeConfig) -> int:
    """Load a checkpoint written by ``save_checkpoint`` into the built objects; return its step.

    RNG states are restored when the checkpoint's parallel layout equals this run's (otherwise each
    rank keeps its freshly seeded streams: only dropout masks can differ from an uninterrupted run).
    """
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(path))
    state = _sharded_state(model, optimizer, is_loading=True)
    same_layout = common["layout"] == parallel_layout(cfg)
    if same_layout:
        state["rng_state"] = _rng_object(None)
    loaded = dist_checkpointing.load(state, str(path))
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_states(loaded["rng_state"])
    return int(loaded["step"])
