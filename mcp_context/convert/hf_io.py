"""Streaming reader and writer of Hugging Face safetensors checkpoints (single file or sharded + index).

Reading goes through the ``safetensors`` library (the format's maintained reference), which checks a
file completely before anything is read: header size, JSON, dtype names, every tensor's byte range
against its shape and dtype, and that the ranges tile the data exactly (no negative, overlapping or
out-of-file offsets, no gaps, no trailing bytes). A tensor is read by opening its file, taking the
tensor (a view of the file's pages, loaded on first touch) and closing it, so the pages of one
tensor at most are resident. Writing is ours: the shards are planned and their headers written up
front, then each tensor's bytes go straight to their offset, so memory stays near one tensor.
Everything is written under a temporary directory that is renamed into place at the end.
It knows nothing about Llama names (``mapping``) or configs (``model_config``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from mcp_context.convert.staging import prepare_staging_dir

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_HEADER_ALIGN = 8

DTYPE_FROM_SAFETENSORS = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_FROM_DTYPE = {v: k for k, v in DTYPE_FROM_SAFETENSORS.items()}


class MissingTensorError(KeyError):
    """A tensor the model needs is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0])


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint: the file that holds it, its dtype and shape."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in ``path``; a missing file, non-UTF-8 text, invalid JSON or a non-object is an
    error naming the file and ``what`` it should hold."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found; it should be {what}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc}); it should be {what}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); it should be {what}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object; it should be {what}")
    return data


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """``safetensors.safe_open(path)``, which validates the whole file first; the library's errors (and
    OS errors) become one ``ValueError`` naming the file."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise ModuleNotFoundError("reading Hugging Face checkpoints needs the safetensors package; "
                                  "install it with: pip install safetensors") from None
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a valid safetensors file ({exc}); the file is damaged or was not "
                         f"written by a safetensors writer: re-download or re-export it") from None


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Name -> :class:`TensorInfo` of every tensor in one ``.safetensors`` file (after the library's checks)."""
    infos = {}
    with open_safetensors(path) as f:
        for name in f.keys():
            piece = f.get_slice(name)
            dtype_name = piece.get_dtype()
            if dtype_name not in DTYPE_FROM_SAFETENSORS:
                raise ValueError(f"tensor {name!r} in {path} has dtype {dtype_name!r}, which this converter "
                                 f"does not support (supported: {sorted(DTYPE_FROM_SAFETENSORS)})")
            infos[name] = TensorInfo(name, path, DTYPE_FROM_SAFETENSORS[dtype_name], tuple(piece.get_shape()))
    return infos


class HFCheckpointReader:
    """Read-only view of a Hugging Face checkpoint directory: ``config.json`` and its tensors."""

    def __init__(self, ckpt_dir: str | os.PathLike):
        self.dir = Path(ckpt_dir)
        config_path = self.dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found; pass a Hugging Face model directory "
                                    f"(with config.json and *.safetensors)")
        self.config: dict = read_json_object(config_path, "the model's Hugging Face config")
        index_path = self.dir / SAFETENSORS_INDEX
        if index_path.is_file():
            weight_map = _weight_map(index_path)
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_FILE).is_file():
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise FileNotFoundError(f"{self.dir} has neither {SAFETENSORS_INDEX} nor {SINGLE_FILE}; this "
                                    f"converter reads safetensors only (never pickled *.bin files)")
        self._infos: dict[str, TensorInfo] = {}
        for file in files:
            for name, info in read_safetensors_header(self.dir / file).items():
                if weight_map is not None and weight_map.get(name) != file:
                    raise ValueError(f"tensor {name!r} is in {file} but {SAFETENSORS_INDEX} says "
                                     f"{weight_map.get(name)!r}; the index does not match the shards")
                self._infos[name] = info
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self._infos))
            if missing:
                raise MissingTensorError(f"{SAFETENSORS_INDEX} lists {missing[:5]} but no shard holds them")

    def names(self) -> list[str]:
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        if name not in self._infos:
            raise MissingTensorError(f"checkpoint {self.dir} has no tensor {name!r}")
        return self._infos[name]

    def read(self, name: str) -> torch.Tensor:
        """One tensor, backed by its file's pages until it is freed (the file is closed on return, so
        nothing else of the file stays mapped)."""
        info = self.info(name)
        with open_safetensors(info.path) as f:  # validated again: the file may have changed since
            tensor = f.get_tensor(name) if name in f.keys() else None
        if tensor is None or tensor.dtype != info.dtype or tuple(tensor.shape) != info.shape:
            raise ValueError(f"{info.path} changed while being read: tensor {name!r} is no longer "
                             f"{info.dtype}{list(info.shape)}; convert again from a checkpoint nothing writes to")
        return tensor


def _weight_map(index_path: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file name in the same directory), checked."""
    index = read_json_object(index_path, "a safetensors index ({'weight_map': {tensor name: shard file}})")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path} has no 'weight_map' object mapping tensor names to shard file names; "
                         f"the index is damaged: re-download it")
    for file in sorted(set(weight_map.values())):
        if file in ("", ".", "..") or Path(file).name != file:
            raise ValueError(f"{index_path} maps tensors to {file!r}, which is not a file name in "
                             f"{index_path.parent}; shards must sit next to the index")
        if not (index_path.parent / file).is_file():
            raise FileNotFoundError(f"{index_path} maps tensors to {file}, which is not in {index_path.parent}; "
                                    f"the download is incomplete")
    return weight_map


def _encode_header(entries: dict) -> bytes:
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % _HEADER_ALIGN)
    return struct.pack("<Q", len(header)) + header


class HFCheckpointWriter:
    """Write a sharded safetensors checkpoint whose tensor list is known up front.

    The constructor plans the shards (in the given order, each at most ``max_shard_bytes`` unless a
    single tensor is larger) and writes every header; :meth:`write` then puts one tensor's bytes at
    its offset, in any order; :meth:`finish` checks that every tensor was written, writes the index
    and renames the directory into place. Use it as a context manager so a failure removes the
    partial output.
    """

    def __init__(self, out_dir: str | os.PathLike, tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive, e.g. {DEFAULT_MAX_SHARD_BYTES}")
        self.out_dir = Path(out_dir)
        self._tmp = prepare_staging_dir(self.out_dir)
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
        shard_bytes = 0
        for name, shape, dtype in tensors:
            if dtype not in SAFETENSORS_FROM_DTYPE:
                raise ValueError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store here")
            nbytes = dtype.itemsize
            for s in shape:
                nbytes *= s
            if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
                shards.append([])
                shard_bytes = 0
            shards[-1].append((name, tuple(shape), dtype, nbytes))
            shard_bytes += nbytes
        n = len(shards)
        self._plan: dict[str, tuple[TensorInfo, int]] = {}  # name -> (tensor, its first byte in the file)
        self._weight_map: dict[str, str] = {}
        self._total = 0
        for i, shard in enumerate(shards):
            file = SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            entries, offset = {"__metadata__": {"format": "pt"}}, 0
            for name, shape, dtype, nbytes in shard:
                if name in self._plan:
                    raise ValueError(f"tensor {name!r} is listed twice")
                entries[name] = {"dtype": SAFETENSORS_FROM_DTYPE[dtype], "shape": list(shape),
                                 "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            header = _encode_header(entries)
            path = self._tmp / file
            with open(path, "wb") as f:
                f.write(header)
                f.truncate(len(header) + offset)
            for name, shape, dtype, nbytes in shard:
                begin = len(header) + entries[name]["data_offsets"][0]
                self._plan[name] = (TensorInfo(name, path, dtype, shape), begin)
                self._weight_map[name] = file
            self._total += offset
        self._written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` as ``name``; its dtype and shape must be the planned ones."""
        if name not in self._plan:
            raise MissingTensorError(f"tensor {name!r} was not planned for {self.out_dir}")
        info, begin = self._plan[name]
        if tensor.dtype != info.dtype or tuple(tensor.shape) != info.shape:
            raise ValueError(f"tensor {name!r} is {tensor.dtype}{list(tensor.shape)} but "
                             f"{info.dtype}{list(info.shape)} was planned")
        with open(info.path, "r+b") as f:
            f.seek(begin)
            if tensor.numel():
                f.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        self._written.add(name)

    def add_file(self, relative_path: str, data: bytes) -> None:
        """Put a non-tensor file (``config.json``, tokenizer files) into the output."""
        path = self._tmp / relative_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def finish(self) -> Path:
        missing = sorted(set(self._plan) - self._written)
        if missing:
            raise MissingTensorError(f"{len(missing)} planned tensors were never written, e.g. {missing[:3]}")
        if len(set(self._weight_map.values())) > 1:
            index = {"metadata": {"total_size": self._total}, "weight_map": self._weight_map}
            self.add_file(SAFETENSORS_INDEX, json.dumps(index, indent=2).encode())
        os.replace(self._tmp, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "HFCheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> Optional[bool]:
        if exc_type is not None:
            self.abort()
        return None
