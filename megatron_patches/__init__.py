"""Small, probe-guarded patches that let megatron-core 0.16.x run mcp_context on CPU and fix two bugs.

    import megatron_patches
    megatron_patches.apply_all(device="cpu")   # or "cuda"; None: the CPU exactly when CUDA is absent

The CPU patches are applied when the run is on the CPU, also on a machine that has CUDA, and hold for
the rest of the process. Each patch is idempotent, names the megatron-core versions it targets in its
module docstring, and is applied only when a probe shows the problem in the installed megatron-core
(never by comparing version strings). See docs/megatron_patches.md.
"""
from __future__ import annotations

from typing import Callable

from megatron_patches.cpu_shims import DeviceLike, apply_cpu_shims, runs_on_cpu
from megatron_patches.cpu_training import apply_cpu_training_shims
from megatron_patches.expert_bias_in_place import apply_expert_bias_out_of_place
from megatron_patches.hcp_groups import apply_hcp_groups_reset
from megatron_patches.hybrid_cp_on_cpu import apply_hybrid_cp_on_cpu
from megatron_patches.mla_without_te import apply_mla_without_te
from megatron_patches.moe_router_without_te import apply_moe_router_without_te
from megatron_patches.per_layer_cp_comm_type import apply_per_layer_cp_comm_type_fix
from megatron_patches.torch_norm_sequence_parallel import apply_torch_norm_sequence_parallel

# Patches that run megatron-core on the CPU; they take the run's device, the others apply everywhere.
CPU_PATCHES: dict[str, Callable[[DeviceLike], list[str]]] = {
    "cpu_shims": apply_cpu_shims,
    "cpu_training": apply_cpu_training_shims,
    "hybrid_cp_on_cpu": apply_hybrid_cp_on_cpu,
}
PATCHES: dict[str, Callable[..., list[str]]] = {
    **CPU_PATCHES,
    "expert_bias_in_place": apply_expert_bias_out_of_place,
    "hcp_groups": apply_hcp_groups_reset,
    "mla_without_te": apply_mla_without_te,
    "moe_router_without_te": apply_moe_router_without_te,
    "per_layer_cp_comm_type": apply_per_layer_cp_comm_type_fix,
    "torch_norm_sequence_parallel": apply_torch_norm_sequence_parallel,
}


def apply_all(device: DeviceLike = None) -> dict[str, list[str]]:
    """Apply every patch (idempotent); returns, per patch, the names it patched in this call.

    `device` is where megatron-core runs in this process: ``"cpu"`` applies the CPU patches (also
    on a machine with CUDA), a CUDA device skips them; None means the CPU exactly when CUDA is absent.
    """
    return {name: apply(device) if name in CPU_PATCHES else apply() for name, apply in PATCHES.items()}


__all__ = [
    "CPU_PATCHES",
    "DeviceLike",
    "PATCHES",
    "apply_all",
    "apply_cpu_shims",
    "apply_cpu_training_shims",
    "apply_expert_bias_out_of_place",
    "apply_hcp_groups_reset",
    "apply_hybrid_cp_on_cpu",
    "apply_per_layer_cp_comm_type_fix",
    "apply_torch_norm_sequence_parallel",
    "runs_on_cpu",
]
