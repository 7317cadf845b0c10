"""MLA without Transformer Engine: megatron-core 0.16.x's `MultiLatentAttention.__init__` crashes.

`megatron.core.transformer.multi_latent_attention` sets ``HAVE_TE = True`` when its import of
`megatron.core.extensions.transformer_engine` succeeds, which it does without TE installed (that
module guards its own TE import and leaves a ``MagicMock`` as ``TELinear``). `__init__` then runs
``isinstance(self.linear_proj, TELinear)`` and raises "isinstance() arg 2 must be a type". The
patch runs `__init__` with ``HAVE_TE`` False when ``TELinear`` is not a class; with TE installed the
probe finds nothing to fix. Applied on every device (a GPU machine without TE has the same crash).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from megatron.core.transformer import multi_latent_attention as mla

from megatron_patches._patching import is_patched, qualified_name, replace_attribute, run_inside


def _claims_te_without_it() -> bool:
    return bool(getattr(mla, "HAVE_TE", False)) and not isinstance(getattr(mla, "TELinear", None), type)


@contextlib.contextmanager
def _without_te() -> Iterator[None]:
    claimed = mla.HAVE_TE
    mla.HAVE_TE = False
    try:
        yield
    finally:
        mla.HAVE_TE = claimed


def apply_mla_without_te() -> list[str]:
    """Patch `MultiLatentAttention.__init__` when the module claims TE that is not there (idempotent);
    returns the qualified names patched by this call."""
    owner, name = mla.MultiLatentAttention, "__init__"
    if is_patched(owner, name) or not _claims_te_without_it():
        return []
    return [qualified_name(owner, name)] if replace_attribute(owner, name, run_inside(_without_te)) else []
