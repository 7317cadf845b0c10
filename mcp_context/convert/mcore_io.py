"""Megatron-Core ``torch_dist`` checkpoints (megatron-core ``dist_checkpointing`` format), streamed.

Owns writing and reading the on-disk format that ``megatron.core.dist_checkpointing.load`` reads:
``metadata.json`` (backend ``torch_dist``), ``common.pt`` and a PyTorch Distributed Checkpoint
(``.metadata`` + ``*.distcp``) whose keys are megatron-core sharded-tensor keys with their *global*
shapes (per-layer tensors stacked on a leading layer axis). Because the stored tensors are global,
the same checkpoint loads at any TP / PP / CP layout.

Writing goes through ``torch.distributed.checkpoint.save`` with a planner that produces each chunk
only when the writer asks for it (one file per chunk, so a chunk is freed once written), inside a
temporary directory renamed into place at the end. It never forks (megatron's own saver starts
writer processes and needs CUDA); several ranks may save one checkpoint together (each its chunks).
Reading asks for one chunk at a time and reads ``.metadata`` with an allow-list unpickler
(``mcp_context.safe_pickle``), so a checkpoint cannot run code. It knows nothing about Hugging Face names (``mapping``).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mcp_context.convert.hf_io import MissingTensorError, read_json_object
from mcp_context.convert.staging import prepare_staging_dir
from mcp_context.safe_pickle import SafeFileSystemReader

CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
DCP_METADATA_FILE = ".metadata"
# megatron.core.dist_checkpointing.core.CheckpointingConfig for the torch_dist backend
MCORE_CHECKPOINT_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                           "common_backend": "torch", "common_backend_version": 1}
EXTRA_DIR = "mcp_context"  # our additions: the architecture record and the original HF side files
_SINGLE_PROCESS_NOTICE = ".*torch.distributed is disabled, unavailable or uninitialized.*"


@dataclass(frozen=True)
class TensorChunk:
    """One chunk of a global tensor, produced on demand.

    ``offsets``/``sizes`` place the chunk in the tensor of ``global_shape``; ``load()`` returns a
    tensor of shape ``sizes`` and dtype ``dtype`` (called once, when the chunk is written).
    """

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans from :class:`TensorChunk` descriptions and materialises each chunk only in ``resolve_data``."""

    def __init__(self, chunks: Sequence[TensorChunk], objects: dict[str, bytes],
                 on_written: Optional[Callable[[TensorChunk], None]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.key, tuple(c.offsets)): c for c in chunks}
        if len(self._chunks) != len(chunks):
            raise ValueError("two chunks share a key and offsets; each chunk must be listed once")
        self._objects = objects
        self._on_written = on_written

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(c.key, torch.Size(c.offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                               properties=TensorProperties(dtype=c.dtype), size=torch.Size(c.global_shape)))
                 for c in self._chunks.values()]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self._objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._objects[write_item.index.fqn])
        chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        tensor = chunk.load()
        if tuple(tensor.shape) != tuple(chunk.sizes) or tensor.dtype != chunk.dtype:
            raise ValueError(f"chunk {chunk.key} at {list(chunk.offsets)} produced {tensor.dtype}"
                             f"{list(tensor.shape)}, expected {chunk.dtype}{list(chunk.sizes)}")
        if self._on_written is not None:
            self._on_written(chunk)
        return tensor.contiguous()


@contextlib.contextmanager
def _dcp_errors_unwrapped() -> Iterator[None]:
    """torch DCP wraps every rank's error in a ``CheckpointException`` (a ``BaseException``, which
    ``except Exception`` misses); re-raise the first failing rank's own error instead."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTICE)
            yield
    except CheckpointException as exc:
        failures = exc.failures
        if not failures:
            raise
        first = failures[min(failures)]
        raise (first[0] if isinstance(first, tuple) else first) from exc


def _use_dist(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None or (dist.is_available() and dist.is_initialized())


def _on_first_rank(fn: Callable[[], Any], rank: int, distributed: bool, group: Optional[dist.ProcessGroup]) -> Any:
    """Run ``fn`` on the group's first rank and give every rank its result, or raise its error on
    every rank (so no rank is left waiting in a collective for one that failed)."""
    holder: list[Any] = [None]
    if rank == 0:
        try:
            holder[0] = ("ok", fn())
        except Exception as exc:
            holder[0] = ("error", exc)
    if distributed:
        dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    status, value = holder[0]
    if status == "error":
        raise value
    return value


def save_chunks(ckpt_dir: str | os.PathLike, chunks: Sequence[TensorChunk], objects: Optional[dict[str, bytes]] = None,
                extra_files: Optional[dict[str, bytes]] = None, group: Optional[dist.ProcessGroup] = None,
                on_written: Optional[Callable[[TensorChunk], None]] = None) -> Path:
    """Write a megatron-core ``torch_dist`` checkpoint made of ``chunks`` (this rank's share).

    ``objects`` are sharded-object entries (``unique_key -> torch.save`` bytes, e.g. ``_extra_state``);
    ``extra_files`` (relative path -> bytes) are written by the first rank. When ``torch.distributed``
    is initialised, every rank of ``group`` (default: the world) must call this with its own chunks.
    """
    final = Path(ckpt_dir)
    distributed = _use_dist(group)
    rank = dist.get_rank(group) if distributed else 0

    def stage() -> str:
        tmp = prepare_staging_dir(final)
        (tmp / CONFIG_FILE).write_text(json.dumps(MCORE_CHECKPOINT_CONFIG))
        torch.save({}, tmp / COMMON_FILE)
        for rel, data in (extra_files or {}).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        return str(tmp)

    tmp = Path(_on_first_rank(stage, rank, distributed, group))
    try:
        with _dcp_errors_unwrapped():  # DCP's collectives give every rank the error of any rank
            dcp.save({}, storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=False, thread_count=1),
                     planner=_StreamingSavePlanner(chunks, objects or {}, on_written),
                     process_group=group, no_dist=not distributed)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _on_first_rank(lambda: os.replace(tmp, final), rank, distributed, group)
    return final


def chunks_from_sharded_state_dict(sharded_state_dict: dict) -> tuple[list[TensorChunk], dict[str, bytes]]:
    """This rank's main-replica chunks and sharded objects of a megatron-core sharded state dict
    (e.g. ``model.sharded_state_dict()``), ready for :func:`save_chunks`."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor, apply_factories,
                                                          is_main_replica)

    apply_factories(sharded_state_dict)
    chunks, objects = [], {}
    for item in nested_values(sharded_state_dict):
        if isinstance(item, ShardedTensor):
            if item.flattened_range is not None:
                raise ValueError(f"sharded tensor {item.key} is flattened (distributed-optimizer state); "
                                 f"only model weights can be saved here")
            if not is_main_replica(item.replica_id):
                continue
            sizes = (1,) * item.prepend_axis_num + tuple(item.local_shape)
            data = item.data
            chunks.append(TensorChunk(item.key, tuple(item.global_shape), tuple(item.global_offset), sizes,
                                      data.dtype, lambda data=data, sizes=sizes: data.detach().reshape(sizes)))
        elif isinstance(item, ShardedObject):
            if is_main_replica(item.replica_id):
                buf = io.BytesIO()
                torch.save([item.data], buf)  # the layout megatron's torch_dist strategy uses
                objects[item.unique_key] = buf.getvalue()
        else:
            raise ValueError(f"cannot save sharded state-dict entry of type {type(item).__name__}")
    return chunks, objects


def save_model(model: torch.nn.Module, ckpt_dir: str | os.PathLike, extra_files: Optional[dict[str, bytes]] = None,
               group: Optional[dist.ProcessGroup] = None) -> Path:
    """Save a megatron-core model's weights (``model.sharded_state_dict()``) at its current TP/PP layout."""
    chunks, objects = chunks_from_sharded_state_dict(model.sharded_state_dict())
    return save_chunks(ckpt_dir, chunks, objects, extra_files, group)


# ---- reading --------------------------------------------------------------------------------------

class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Loads, for each requested key, the chunk starting at the requested offsets (resharding as needed)."""

    def __init__(self, offsets: dict[str, tuple[int, ...]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, dest in self.state_dict.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(self._offsets[key]), sizes=dest.size())
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(items)

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        dest = self.state_dict[read_item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, offset, length)
        return dest


class McoreCheckpointReader:
    """Read-only view of a megatron-core ``torch_dist`` checkpoint, one chunk at a time."""

    def __init__(self, ckpt_dir: str | os.PathLike):
        self.dir = Path(ckpt_dir)
        config_path = self.dir / CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found; pass a megatron-core dist_checkpointing "
                                    f"directory (the one holding metadata.json and .metadata)")
        backend = read_json_object(config_path, "megatron-core's checkpoint config").get("sharded_backend")
        if backend != "torch_dist":
            raise ValueError(f"{self.dir} uses sharded_backend={backend!r}; only 'torch_dist' is supported "
                             f"(re-save it with megatron-core's torch_dist strategy)")
        self._reader = SafeFileSystemReader(self.dir)
        self._md = self._reader.read_metadata().state_dict_metadata

    def keys(self) -> list[str]:
        """Tensor keys (sharded objects such as ``_extra_state`` are left out)."""
        return [k for k, md in self._md.items() if hasattr(md, "size")]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensor_md(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensor_md(key).properties.dtype

    def _tensor_md(self, key: str) -> Any:
        md = self._md.get(key)
        if md is None or not hasattr(md, "size"):
            raise MissingTensorError(f"megatron checkpoint {self.dir} has no tensor {key!r}")
        return md

    def read(self, key: str, offsets: Optional[Sequence[int]] = None,
             sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The chunk of ``key`` at ``offsets`` of shape ``sizes`` (default: the whole tensor)."""
        shape = self.shape(key)
        offsets = tuple(offsets) if offsets is not None else (0,) * len(shape)
        sizes = tuple(sizes) if sizes is not None else shape
        if len(offsets) != len(shape) or any(o < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise ValueError(f"chunk offsets={list(offsets)} sizes={list(sizes)} is outside {key} of shape {list(shape)}")
        dest = torch.empty(sizes, dtype=self.dtype(key))
        try:
            with _dcp_errors_unwrapped():
                dcp.load({key: dest}, storage_reader=self._reader, planner=_ChunkLoadPlanner({key: offsets}),
                         no_dist=True)
        except Exception as exc:  # whatever torch.load or the file system raise on a damaged or missing file
            files = sorted({info.relative_path for index, info in self._reader.read_metadata().storage_data.items()
                            if index.fqn == key})
            raise ValueError(f"cannot read tensor {key!r} of {self.dir} from {', '.join(files)} "
                             f"({type(exc).__name__}: {str(exc)[:200]}); the checkpoint is damaged or "
                             f"incomplete: copy it again or convert from another copy") from exc
        return dest

    def read_layer(self, key: str, layer: int) -> torch.Tensor:
        """Layer ``layer`` of a stacked per-layer tensor (without the leading layer axis)."""
        shape = self.shape(key)
        return self.read(key, (layer,) + (0,) * (len(shape) - 1), (1,) + shape[1:])[0]

    def extra_file(self, relative_path: str) -> Optional[bytes]:
        path = self.dir / relative_path
        return path.read_bytes() if path.is_file() else None
