"""Reading checkpoint files without running their code: the one place the package unpickles.

A pickle can call any importable function while it loads (``os.system``, ``os.mkdir``...), so a
checkpoint planted or damaged on disk must never reach ``pickle.load`` or ``torch.load`` with
``weights_only=False``. Checkpoints hold three kinds of pickles, each read here:

- torch DCP ``.metadata`` (plain pickle of ``torch.distributed.checkpoint.metadata`` dataclasses):
  :func:`load_dcp_metadata` / :class:`SafeFileSystemReader`, through :class:`AllowListUnpickler`,
  which builds only those dataclasses, ``torch.Size`` and torch dtypes / layouts;
- ``torch.save`` files and byte objects (megatron-core's ``common.pt``, sharded objects such as RNG
  states): :func:`torch_load`, i.e. ``torch.load(weights_only=True)`` (tensors, containers, numbers);
- megatron-core ``dist_checkpointing.load``, which would read both of the above unrestricted
  (``FileSystemReader.read_metadata`` is ``pickle.load``; DCP's planner loads byte objects with
  ``weights_only=False``): :func:`mcore_load_strategies` gives it load strategies that use the two
  readers above.

Bottom-level: imports nothing from ``mcp_context``; megatron-core only inside
:func:`mcore_load_strategies`.
"""
from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, BinaryIO, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

DCP_METADATA_FILE = ".metadata"

_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
}


class AllowListUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` only: its dataclasses, ``torch.Size`` and torch dtypes/layouts.

    Any other global (a function a payload would call) raises ``pickle.UnpicklingError`` before it
    is looked up, so nothing runs.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not a "
                                     f"checkpoint-metadata type; refusing to load it")


def load_dcp_metadata(path: Union[str, os.PathLike]) -> Metadata:
    """The torch DCP ``Metadata`` in file ``path``, read with :class:`AllowListUnpickler`.

    Raises ``pickle.UnpicklingError`` naming ``path`` when the file refers to anything else, is
    truncated, or is not a pickle of ``Metadata``.
    """
    try:
        with open(path, "rb") as f:
            metadata = AllowListUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as err:
        raise pickle.UnpicklingError(f"{path}: {err or type(err).__name__} (truncated or not torch DCP "
                                     f"checkpoint metadata)") from err
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not torch DCP checkpoint metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch DCP's ``FileSystemReader`` that reads ``.metadata`` with :func:`load_dcp_metadata` (cached)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self, "_cached_metadata", None) is None:
            metadata = load_dcp_metadata(Path(self.path) / DCP_METADATA_FILE)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._cached_metadata = metadata
        return self._cached_metadata


def torch_load(source: Union[str, os.PathLike, BinaryIO]) -> Any:
    """``torch.load(source, map_location="cpu", weights_only=True)``: tensors, containers and numbers only."""
    return torch.load(source, map_location="cpu", weights_only=True)


def mcore_load_strategies() -> tuple[Any, Any]:
    """(sharded, common) load strategies for ``megatron.core.dist_checkpointing.load`` of a
    ``torch_dist`` checkpoint that unpickle nothing unrestricted.

    megatron-core's own ``TorchDistLoadShardedStrategy.load`` with two changes: the DCP reader is
    :class:`SafeFileSystemReader` and byte objects are read with :func:`torch_load`; the common
    strategy reads ``common.pt`` with :func:`torch_load`. (``torch_dist`` keeps sharded objects in the
    DCP files, so the common strategy's ``load_sharded_objects`` is never called; pass no ``strict``
    that needs the checkpoint's sharded metadata.)
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (MCoreLoadPlanner, TorchDistLoadShardedStrategy,
                                                                   _replace_sharded_keys_with_state_dict_keys,
                                                                   _replace_state_dict_keys_with_sharded_keys,
                                                                   _restore_dict_types, _unwrap_pyt_sharded_tensor,
                                                                   mcore_to_pyt_state_dict)
    from torch.distributed import checkpoint
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(MCoreLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:  # DefaultLoadPlanner's, weights only
            loaded = torch_load(value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    class SafeTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
        """megatron-core's ``torch_dist`` load, reading metadata and byte objects without running code."""

        def load(self, sharded_state_dict: dict, checkpoint_dir: Path) -> dict:
            values = list(nested_values(sharded_state_dict))
            validated = [t for t in values if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
            mismatch = {t.key: t for t in values if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
            original = sharded_state_dict
            sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
            reader = SafeFileSystemReader(checkpoint_dir)
            # Read (and refuse) the metadata here: DCP itself catches a reader's error, and torch 2.11
            # reports only "metadata is None" in its place.
            self.cached_global_metadata = reader.read_metadata()
            planner = SafeLoadPlanner(shapes_validation_sharded_tensors=validated,
                                      allow_shape_mismatch_sharded_tensors=mismatch)
            checkpoint.load(pyt_state_dict, storage_reader=reader, planner=planner)
            state = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
            state = _replace_sharded_keys_with_state_dict_keys(state, flat_mapping, rename_mapping)
            _restore_dict_types(state, original)
            return state

    class SafeTorchCommonLoadStrategy(TorchCommonLoadStrategy):
        """megatron-core's ``common.pt`` load with ``weights_only=True``."""

        def load_common(self, checkpoint_dir: Union[str, Path]) -> dict:
            return torch_load(os.path.join(checkpoint_dir, COMMON_STATE_FNAME))

    return SafeTorchDistLoadStrategy(), SafeTorchCommonLoadStrategy()
