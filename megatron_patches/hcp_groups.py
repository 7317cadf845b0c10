"""Reset of the hierarchical context-parallel groups on `parallel_state.destroy_model_parallel()`.

Targets megatron-core 0.16.x (seen on 0.16.1), where `destroy_model_parallel()` sets every group
global to None except `_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS`. Re-initialising model parallelism in
one process (tests, notebooks, a trainer that rebuilds its layout) without
`hierarchical_context_parallel_sizes` then still hands the old, possibly destroyed, groups to
`get_hierarchical_context_parallel_groups()` and to every `ProcessGroupCollection` built from it.

`apply_hcp_groups_reset()` wraps `destroy_model_parallel` so it also sets that global to None.
Guarded by a probe that reads `destroy_model_parallel`'s code: a release that resets the global
itself is left alone.
"""
from __future__ import annotations

import functools
from typing import Callable

from megatron.core import parallel_state

from megatron_patches._patching import is_patched, qualified_name, replace_attribute

HCP_GROUPS_GLOBAL = "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS"


def destroy_leaves_hcp_groups(destroy_model_parallel: Callable) -> bool:
    """Probe: `parallel_state` holds the HCP groups global and `destroy_model_parallel` never sets it."""
    return hasattr(parallel_state, HCP_GROUPS_GLOBAL) and (
        HCP_GROUPS_GLOBAL not in destroy_model_parallel.__code__.co_names
    )


def _destroy_resetting_hcp_groups(original: Callable) -> Callable:
    @functools.wraps(original)
    def destroy_model_parallel() -> None:
        original()
        setattr(parallel_state, HCP_GROUPS_GLOBAL, None)

    return destroy_model_parallel


def apply_hcp_groups_reset() -> list[str]:
    """Make `destroy_model_parallel()` also forget the hierarchical CP groups. Idempotent.

    Returns the qualified names patched by this call (empty when already applied or not needed).
    """
    if is_patched(parallel_state, "destroy_model_parallel") or not destroy_leaves_hcp_groups(
        parallel_state.destroy_model_parallel
    ):
        return []
    replace_attribute(parallel_state, "destroy_model_parallel", _destroy_resetting_hcp_groups)
    return [qualified_name(parallel_state, "destroy_model_parallel")]
