"""Random-weight Hugging Face checkpoints of any size, written tensor by tensor.

For measuring the converters on models too large to build with ``transformers`` on a small
machine: weights are drawn one tensor at a time and streamed to safetensors shards, so even a
multi-GB checkpoint is written in the memory of its largest tensor. Not a model initialiser.
"""
from __future__ import annotations

import json
import os

import torch
from tqdm.auto import tqdm

from mcp_context.convert.hf_io import DEFAULT_MAX_SHARD_BYTES, HFCheckpointWriter
from mcp_context.convert.mapping import hf_tensors
from mcp_context.convert.model_config import hf_model_from_config


def write_random_hf_checkpoint(out_dir: str | os.PathLike, config: dict, dtype: torch.dtype = torch.bfloat16,
                               seed: int = 0, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> int:
    """Write ``config`` (an HF ``config.json`` dict) and random weights to ``out_dir``; return the bytes written."""
    arch = hf_model_from_config(config)
    tensors = [(name, shape, dtype) for name, shape, _ in hf_tensors(arch.shape, arch.model_type)]
    generator = torch.Generator().manual_seed(seed)
    total = 0
    with HFCheckpointWriter(out_dir, tensors, max_shard_bytes) as writer:
        for name, shape, _ in tqdm(tensors, desc="random weights", unit="tensor", disable=None):
            tensor = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(0.02).to(dtype)
            writer.write(name, tensor)
            total += tensor.nbytes
            del tensor
        writer.add_file("config.json", json.dumps({**config, "torch_dtype": str(dtype).removeprefix("torch.")},
                                                  indent=2).encode())
        writer.finish()
    return total
