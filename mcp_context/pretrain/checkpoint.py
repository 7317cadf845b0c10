"""Training checkpoints: megatron-core ``dist_checkpointing``, written under a temporary name, then pointed at.

Layout of ``checkpoint.save``::

    iter_0000010/      megatron-core torch_dist checkpoint: the model's and the optimizer's sharded
                       state (reshardable), common.pt with the scheduler, step and layout, one RNG
                       object per rank, and recipe.yaml (the resolved recipe of the run)
    latest             the name of the newest complete checkpoint ("iter_0000010")

Saving: every rank writes into ``iter_0000010.tmp``; once all have finished, rank 0 renames it to
``iter_0000010`` and only then replaces ``latest`` (temporary file + ``os.replace``). On a GPU the
tensors go through megatron-core's default ``torch_dist`` writer; on the CPU through
``InProcessTorchDistSaveStrategy``, which writes the same format from the calling process
(megatron-core's writer forks writer processes and spawns a manager process on first use: slow for
small CPU jobs, and impossible in daemonic processes such as worker pools). A crash at any
moment leaves ``latest`` naming a complete checkpoint (or no ``latest`` at all); the resumed run
deletes the crash's ``.tmp`` directories, and a save replaces a complete checkpoint that ``latest``
never named. The model weights and Adam moments are stored with their global shapes, so a run
resumes at any CP size (and, for the weights, any TP size); the per-rank RNG states are restored
only when the parallel layout is unchanged.

Resuming (``checkpoint_to_resume``) trusts nothing on disk: ``latest`` may only hold the name of an
``iter_NNNNNNN`` directory next to it; the checkpoint is checked (``checkpoint_problem``: its files
present, nothing truncated, its pickles readable without running code) before megatron-core reads
it, and then read through ``mcp_context.safe_pickle``; a damaged checkpoint is reported by file with
the newest intact one offered; the recipe stored with it must agree with the run's on every key
that changes the run (``recipe_changes``).
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from mcp_context import safe_pickle
from mcp_context.atomic import write_atomic
from mcp_context.pretrain.build import train_device
from mcp_context.recipes import RESOLVED_RECIPE_FILENAME, RecipeConfig, RecipeError, load_recipe, save_recipe

LATEST_FILENAME = "latest"
TMP_SUFFIX = ".tmp"
CHECKPOINT_NAME = re.compile(r"iter_[0-9]{7}")
# Recipe keys a resumed run may change: they do not change the numbers the run computes (logging,
# evaluation, where checkpoints go, the parallel layout over the same global batch, the device).
# Every other key (batch sizes, steps, schedule, model shape, seeds, data...) must stay as saved.
RESUMABLE_CHANGES = ("name", "description", "logging.", "checkpoint.", "train.eval_interval", "train.eval_iters",
                     "train.world_size", "train.device", "train.micro_batch_size", "model.context_parallel_size",
                     "model.hierarchical_context_parallel_sizes", "model.cp_comm_type", "data.num_workers",
                     "data.cache_dir")


class CheckpointError(RuntimeError):
    """A checkpoint or run directory that cannot be resumed as asked; the message names the file and the fix."""


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps (Megatron-LM's)."""
    return f"iter_{step:07d}"


def _fallback(save_dir: Path, damaged: Optional[Path] = None) -> str:
    """What to do instead of resuming from ``damaged``: the newest intact checkpoint of ``save_dir``, or restart."""
    for candidate in sorted(_checkpoint_dirs(save_dir), reverse=True):
        if candidate != damaged and checkpoint_problem(candidate) is None:
            return (f"the newest intact checkpoint is {candidate}: resume from it with --resume-from {candidate} "
                    f"(or start afresh with --restart, which deletes this run's checkpoints and metrics)")
    return f"{save_dir} holds no intact checkpoint: start afresh with --restart (or use another --run-dir)"


def _checkpoint_dirs(save_dir: Path) -> list[Path]:
    """The complete-looking ``iter_NNNNNNN`` directories of ``save_dir`` (no ``.tmp``)."""
    if not save_dir.is_dir():
        return []
    return [p for p in save_dir.iterdir() if CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir()]


def latest_checkpoint(save_dir: os.PathLike | str) -> Optional[Path]:
    """The checkpoint ``save_dir/latest`` names, or None when there is no ``latest``.

    ``latest`` must hold exactly the name of an ``iter_NNNNNNN`` directory of ``save_dir`` (a path,
    ``..``, a symlink or anything else raises ``CheckpointError`` naming the file and the newest
    intact checkpoint), so a pointer can never lead a run into another run's checkpoints.
    """
    save_dir = Path(save_dir)
    pointer = save_dir / LATEST_FILENAME
    if not pointer.exists():
        return None
    raw = pointer.read_bytes()
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or not CHECKPOINT_NAME.fullmatch(name):
        shown = raw[:60].decode("ascii", errors="replace") if name is None else name[:60]
        raise CheckpointError(f"{pointer} holds {shown!r}, not the name of a checkpoint directory (iter_NNNNNNN) "
                              f"of {save_dir}; {_fallback(save_dir)}")
    path = save_dir / name
    if path.is_symlink() or not (path / "metadata.json").is_file():
        raise CheckpointError(f"{pointer} names {name}, but {path} is not a complete checkpoint directory; "
                              f"{_fallback(save_dir, path)}")
    return path


def checkpoint_problem(path: os.PathLike | str, training: bool = True) -> Optional[str]:
    """What is wrong with checkpoint directory ``path``, naming the file; None when it looks intact.
    ``training=False``: any megatron-core ``torch_dist`` checkpoint (a conversion has no ``recipe.yaml``).

    Reads metadata only: ``metadata.json``, ``recipe.yaml``, ``common.pt`` (weights only), ``.metadata``
    (allow-list unpickler) and the size of every ``.distcp`` file ``.metadata`` refers to. So it
    finds missing and truncated files and pickles that would run code, not flipped bits inside a tensor.
    """
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return f"{path} is not a checkpoint directory"
    config = path / "metadata.json"
    try:
        backend = json.loads(config.read_text(encoding="utf-8")).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as err:
        return f"{config} is missing or damaged ({type(err).__name__}: {err})"
    if backend != "torch_dist":
        return f"{config} says sharded_backend={backend!r}; mcp_context.pretrain writes and reads 'torch_dist'"
    if training and not (path / RESOLVED_RECIPE_FILENAME).is_file():
        return f"{path / RESOLVED_RECIPE_FILENAME} is missing"
    common = path / "common.pt"
    try:
        safe_pickle.torch_load(common)
    except Exception as err:  # any failure to read it back means the file is damaged or not ours
        return f"{common} is missing or damaged ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    try:
        metadata = safe_pickle.load_dcp_metadata(path / safe_pickle.DCP_METADATA_FILE)
    except OSError as err:
        return f"{path / safe_pickle.DCP_METADATA_FILE} is missing ({err.strerror})"
    except pickle.UnpicklingError as err:
        return str(err)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        data = path / relative
        if Path(relative).name != relative:
            return f"{path / safe_pickle.DCP_METADATA_FILE} refers to {relative!r}, outside {path}"
        if not data.is_file():
            return f"{data} is missing ({path / safe_pickle.DCP_METADATA_FILE} refers to it)"
        if data.stat().st_size < size:
            return f"{data} is truncated: {data.stat().st_size} bytes, {size} expected"
    return None


def recipe_changes(saved: RecipeConfig, cfg: RecipeConfig) -> list[str]:
    """``key: saved -> new`` for every key where ``cfg`` differs from ``saved`` in a way that changes
    the run (every key but ``RESUMABLE_CHANGES``)."""
    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[prefix + key] = value
        return out

    old, new = flat(saved.to_dict()), flat(cfg.to_dict())
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key) and not key.startswith(RESUMABLE_CHANGES)]


def checkpoint_to_resume(cfg: RecipeConfig, resume_from: Optional[os.PathLike | str] = None,
                         restart: bool = False) -> Optional[Path]:
    """The checkpoint a run of ``cfg`` starts from, or None to start at step 0. Reads only; no process group.

    ``resume_from`` (an ``iter_NNNNNNN`` directory) wins; ``restart`` starts at step 0 (the caller
    deletes the old checkpoints and metrics). Otherwise the ``latest`` of ``checkpoint.load``, else of
    ``checkpoint.save``. Raises ``CheckpointError`` when ``latest`` is malformed, the checkpoint is
    damaged (naming the file and the newest intact checkpoint), ``checkpoint.save`` holds
    checkpoints but no ``latest`` (a silent restart would overwrite them), or the checkpoint's recipe
    differs from ``cfg`` on a key that changes the run (naming each).
    """
    if resume_from is not None:
        checkpoint = Path(resume_from)
        if not CHECKPOINT_NAME.fullmatch(checkpoint.name):
            raise CheckpointError(f"--resume-from {checkpoint}: give a checkpoint directory (RUN_DIR/checkpoints/"
                                  f"iter_NNNNNNN)")
        save_dir = checkpoint.parent
    elif restart:
        return None
    else:
        save_dir = Path(cfg.checkpoint.load or cfg.checkpoint.save) if (cfg.checkpoint.load or
                                                                       cfg.checkpoint.save) else None
        checkpoint = latest_checkpoint(save_dir) if save_dir is not None else None
        if checkpoint is None:
            found = sorted(p.name for p in _checkpoint_dirs(save_dir)) if save_dir is not None else []
            if found:
                raise CheckpointError(
                    f"{save_dir} holds checkpoints ({', '.join(found)}) but no {LATEST_FILENAME} file: starting at "
                    f"step 0 would overwrite them and metrics.jsonl; {_fallback(save_dir)}")
            return None
    problem = checkpoint_problem(checkpoint)
    if problem is not None:
        raise CheckpointError(f"cannot resume from {checkpoint}: {problem}; {_fallback(save_dir, checkpoint)}")
    try:
        saved = load_recipe(checkpoint / RESOLVED_RECIPE_FILENAME)
    except RecipeError as err:
        raise CheckpointError(f"cannot resume from {checkpoint}: its recipe does not load ({err})") from None
    changes = recipe_changes(saved, cfg)
    if changes:
        raise CheckpointError(
            f"cannot resume from {checkpoint}: the recipe changes {'; '.join(changes)}. These keys change the run; "
            f"set them back (see {checkpoint / RESOLVED_RECIPE_FILENAME}), or start a new run "
            f"(another --run-dir, or --restart)")
    return checkpoint


def remove_run_history(save_dir: Optional[os.PathLike | str], metrics_path: Path) -> list[Path]:
    """Delete ``save_dir``'s checkpoints (``iter_*``, ``latest``) and ``metrics_path`` for ``--restart``; return them.

    Call on one rank before the run saves anything.
    """
    removed = []
    if save_dir is not None and Path(save_dir).is_dir():
        for path in sorted(Path(save_dir).glob("iter_*")) + [Path(save_dir) / LATEST_FILENAME]:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
            else:
                continue
            removed.append(path)
    if metrics_path.exists():
        metrics_path.unlink()
        removed.append(metrics_path)
    return removed


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


def _rng_states(device: torch.device) -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    states = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if device.type == "cuda":
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

    device = train_device(cfg)
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
                 rng_state=_rng_object(_rng_states(device)))
    strategy = None if device.type == "cuda" else _in_process_save_strategy()
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


def load_pretrained_weights(path: os.PathLike | str, model) -> None:
    """Load only the model weights of the megatron-core checkpoint ``path`` (a conversion, or a training
    checkpoint of the same model: its optimizer, step and RNG are not read) into the built DDP-wrapped GPT,
    every parameter of it (strict), at this run's layout. Call it before the optimizer is built, which copies
    the weights it keeps."""
    from megatron.core import dist_checkpointing

    sharded_strategy, common_strategy = safe_pickle.mcore_load_strategies()
    sharded = model.module.sharded_state_dict()
    loaded = dist_checkpointing.load(sharded, str(path), sharded_strategy=sharded_strategy,
                                     common_strategy=common_strategy)
    model.module.load_state_dict({key: loaded[key] for key in sharded})


def load_checkpoint(path: os.PathLike | str, model, optimizer, scheduler, cfg: RecipeConfig) -> int:
    """Load a checkpoint written by ``save_checkpoint`` into the built objects; return its step.

    Unpickles nothing unrestricted (``safe_pickle``); check the checkpoint first (``checkpoint_to_resume``).

    RNG states are restored when the checkpoint's parallel layout equals this run's (otherwise each
    rank keeps its freshly seeded streams: only dropout masks can differ from an uninterrupted run).
    """
    from megatron.core import dist_checkpointing

    common = safe_pickle.torch_load(Path(path) / "common.pt")
    state = _sharded_state(model, optimizer, is_loading=True)
    same_layout = common["layout"] == parallel_layout(cfg)
    if same_layout:
        state["rng_state"] = _rng_object(None)
    sharded_strategy, common_strategy = safe_pickle.mcore_load_strategies()
    loaded = dist_checkpointing.load(state, str(path), sharded_strategy=sharded_strategy,
                                     common_strategy=common_strategy)
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_states(loaded["rng_state"])
    return int(loaded["step"])
