"""Small, probe-guarded patches that let megatron-core 0.16.x run mcp_context on CPU and fix two bugs.

    import megatron_patches
    megatron_patches.apply_all()

Each patch is idempotent, names the megatron-core versions it targets in its module docstring, and
is applied only when a probe shows the problem in the installed megatron-core (never by comparing
version strings). See docs/megatron_patches.md.
"""
from __future__ import annotations

from typing import Callable

from megatron_patches.cpu_shims import apply_cpu_shims
from megatron_patches.cpu_training import apply_cpu_training_shims
from megatron_patches.hcp_groups import apply_hcp_groups_reset
from megatron_patches.per_layer_cp_comm_type import apply_per_layer_cp_comm_type_fix
from megatron_patches.torch_norm_sequence_parallel import apply_torch_norm_sequence_parallel

PATCHES: dict[str, Callable[[], list[str]]] = {
    "cpu_shims": apply_cpu_shims,
    "cpu_training": apply_cpu_training_shims,
    "hcp_groups": apply_hcp_groups_reset,
    "per_layer_cp_comm_type": apply_per_layer_cp_comm_type_fix,
    "torch_norm_sequence_parallel": apply_torch_norm_sequence_parallel,
}


def apply_all() -> dict[str, list[str]]:
    """Apply every patch (idempotent); returns, per patch, the names it patched in this call."""
    return {name: apply() for name, apply in PATCHES.items()}


__all__ = [
    "PATCHES",
    "apply_all",
    "apply_cpu_shims",
    "apply_cpu_training_shims",
    "apply_hcp_groups_reset",
    "apply_per_layer_cp_comm_type_fix",
    "apply_torch_norm_sequence_parallel",
]
