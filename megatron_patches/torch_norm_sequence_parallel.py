"""Sequence parallelism for megatron-core's plain-PyTorch norm (`WrappedTorchNorm`).

Targets megatron-core 0.16.x (seen on 0.16.1). The local layer spec uses `WrappedTorchNorm` when
apex is absent (always on CPU), and it asserts ``not config.sequence_parallel``, so TP > 1 with
sequence parallelism cannot be built from the local spec at all. The norm itself is per token, so
it is correct on a sequence shard; the only thing sequence parallelism needs from it is what
apex's `FusedLayerNorm` and TE's norms do: mark the weight (and bias) ``sequence_parallel=True``,
so that `finalize_model_grads` all-reduces their gradients over the tensor-parallel group (each
rank saw only its slice of the sequence).

`apply_torch_norm_sequence_parallel()` makes `WrappedTorchNorm` build the norm with sequence
parallelism switched off in a shallow copy of the config and then mark its parameters. Guarded by a
probe that building a sequence-parallel `WrappedTorchNorm` fails; applies with or without CUDA.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer import torch_norm

from megatron_patches._patching import is_patched, qualified_name, replace_attribute


def _sequence_parallel_config() -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
        sequence_parallel=True, normalization="RMSNorm",
    )


def torch_norm_rejects_sequence_parallel() -> bool:
    """Probe: does building a `WrappedTorchNorm` under sequence parallelism fail?"""
    try:
        torch_norm.WrappedTorchNorm(_sequence_parallel_config(), 8)
    except AssertionError:
        return True
    return False


def _new_with_sequence_parallel(original: Callable) -> Callable:
    @functools.wraps(original)
    def __new__(cls: type, config: TransformerConfig, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        config_without_sp = copy.copy(config)
        config_without_sp.sequence_parallel = False
        norm = original(cls, config_without_sp, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return __new__


def apply_torch_norm_sequence_parallel() -> list[str]:
    """Let `WrappedTorchNorm` be built with ``sequence_parallel=True`` (params marked for TP reduce).

    Idempotent. Returns the qualified names patched by this call (empty when already applied or when
    the installed megatron-core accepts sequence parallelism in `WrappedTorchNorm` itself).
    """
    owner = torch_norm.WrappedTorchNorm
    if is_patched(owner, "__new__") or not torch_norm_rejects_sequence_parallel():
        return []
    replace_attribute(owner, "__new__", _new_with_sequence_parallel)
    return [qualified_name(owner, "__new__")]
