"""Per-layer `cp_comm_type` lists: layer i (1-based) gets ``cp_comm_type[i - 1]``.

Targets megatron-core 0.16.x (seen on 0.16.1). `TransformerConfig.cp_comm_type` may be a list with
one entry per layer (the config checks ``len == num_layers``), but `TransformerLayer.__init__`
picks ``config.cp_comm_type[self.layer_number]``, and `self.layer_number` is 1-based: every layer
gets the next layer's type and the last layer raises IndexError. `self.layer_number` is already the
global number (local number + `get_transformer_layer_offset`, which accounts for pipeline and
virtual-pipeline stages), and the list is global, so the 1-based shift is the whole bug.

`apply_per_layer_cp_comm_type_fix()` wraps `TransformerLayer.__init__`: while the original runs, a
list `cp_comm_type` is seen through a view indexed by the 1-based layer number; afterwards the
config holds the user's list again. Guarded by a probe that builds two one-module layers and looks
at the type each receives; the probe runs again after patching to confirm the fix.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_patches._patching import is_patched, qualified_name, replace_attribute

_PROBE_TYPES = ["p2p", "a2a"]


class _CpCommTypesByLayerNumber(list):
    """A per-layer `cp_comm_type` list read with 1-based (global) layer numbers."""

    def __getitem__(self, layer_number: Any) -> Any:
        if not isinstance(layer_number, int):
            return super().__getitem__(layer_number)
        if not 1 <= layer_number <= len(self):
            raise IndexError(
                f"cp_comm_type has {len(self)} entries (layers 1..{len(self)}) but layer_number="
                f"{layer_number}; give one cp_comm_type per layer of the whole model (num_layers)"
            )
        return super().__getitem__(layer_number - 1)


def _init_with_one_based_cp_comm_type(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self: TransformerLayer, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        per_layer = config.cp_comm_type
        if not isinstance(per_layer, list) or isinstance(per_layer, _CpCommTypesByLayerNumber):
            original(self, config, *args, **kwargs)
            return
        config.cp_comm_type = _CpCommTypesByLayerNumber(per_layer)
        try:
            original(self, config, *args, **kwargs)
        finally:
            config.cp_comm_type = per_layer

    return __init__


class _CpCommTypeRecorder(torch.nn.Module):
    """Probe attention: records the `cp_comm_type` its layer passes in."""

    def __init__(self, config: TransformerConfig, layer_number: int, cp_comm_type: Optional[str] = None,
                 **kwargs: Any):
        super().__init__()
        self.cp_comm_type = cp_comm_type


def cp_comm_types_received(cp_comm_type: list[str]) -> list[Any]:
    """Probe: build layers 1..len(cp_comm_type) with CP=2 and return the type each one received.

    A layer whose construction raises IndexError is reported as that exception.
    """
    config = TransformerConfig(
        num_layers=len(cp_comm_type), hidden_size=8, num_attention_heads=1,
        context_parallel_size=2, cp_comm_type=list(cp_comm_type),
    )
    pg_collection = ProcessGroupCollection()
    pg_collection.tp = pg_collection.pp = pg_collection.cp = None
    submodules = TransformerLayerSubmodules(self_attention=_CpCommTypeRecorder)
    received: list[Any] = []
    for layer_number in range(1, len(cp_comm_type) + 1):
        try:
            layer = TransformerLayer(
                config, submodules, layer_number=layer_number, pg_collection=pg_collection
            )
        except IndexError as error:
            received.append(error)
        else:
            received.append(layer.self_attention.cp_comm_type)
    return received


def apply_per_layer_cp_comm_type_fix() -> list[str]:
    """Make layer i of a per-layer `cp_comm_type` list get entry i-1. Idempotent.

    Returns the qualified names patched by this call (empty when already applied or not needed).
    Raises RuntimeError if the probe still sees wrong types after patching.
    """
    if is_patched(TransformerLayer, "__init__") or cp_comm_types_received(_PROBE_TYPES) == _PROBE_TYPES:
        return []
    replace_attribute(TransformerLayer, "__init__", _init_with_one_based_cp_comm_type)
    received = cp_comm_types_received(_PROBE_TYPES)
    if received != _PROBE_TYPES:
        raise RuntimeError(
            f"per-layer cp_comm_type fix did not take: layers received {received}, expected "
            f"{_PROBE_TYPES}; this megatron-core's TransformerLayer reads cp_comm_type differently"
        )
    return [qualified_name(TransformerLayer, "__init__")]
