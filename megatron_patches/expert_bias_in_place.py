"""Experts with biases and per-token scales: megatron-core 0.16.x's `MLP.forward` adds the bias in place.

Targets megatron-core 0.16.x (seen on 0.16.1). For an expert MLP with a bias (gpt-oss: ``add_bias_linear``)
that is given per-token routing scales, `MLP.forward` ends with
``output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)``. With local linear layers (no
Transformer Engine) at one tensor-parallel rank, ``output`` is what ``_ReduceFromModelParallelRegion``
returned as it is, and autograd refuses the in-place add on it ("Output 0 of
_ReduceFromModelParallelRegion is a view and is being modified inplace"): a converted gpt-oss cannot
train. The patch runs the same method with that one statement written out of place
(``output = output + ...``): the same values, a new tensor. The probe is the statement itself in the
installed method's source; without it nothing is patched.
"""
from __future__ import annotations

import inspect
import textwrap

from megatron.core.transformer import mlp as mlp_module

from megatron_patches._patching import original_of, qualified_name, replace_attribute

IN_PLACE = "output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)"
OUT_OF_PLACE = "output = output + output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)"


def has_in_place_expert_bias() -> bool:
    """Probe: megatron-core's own `MLP.forward` holds the in-place statement."""
    return IN_PLACE in inspect.getsource(original_of(mlp_module.MLP, "forward"))


def _out_of_place(original):
    lines, first = inspect.getsourcelines(original)
    source = "\n" * (first - 1) + textwrap.dedent("".join(lines))  # tracebacks keep mlp.py's line numbers
    namespace = dict(vars(mlp_module))
    exec(compile(source.replace(IN_PLACE, OUT_OF_PLACE), mlp_module.__file__, "exec"), namespace)  # noqa: S102
    return namespace[original.__name__]


def apply_expert_bias_out_of_place() -> list[str]:
    """Patch `MLP.forward` where the probe finds the in-place add (idempotent); returns what was patched."""
    if not has_in_place_expert_bias():
        return []
    return [qualified_name(mlp_module.MLP, "forward")] if replace_attribute(mlp_module.MLP, "forward",
                                                                            _out_of_place) else []
