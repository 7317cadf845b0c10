"""Errors against the reference, and the bar each one is held to.

- fp64 / fp32: max abs error <= ``TOL[dtype] * max(1, max|reference|)`` for every output. The inputs
  are rounded to the dtype once and the reference runs in fp64 on those rounded inputs, so the error
  is the computation's alone: fp64 differs from an explicit softmax only by summation order (~1e-15),
  fp32 by fp32 accumulation over the sequence (~1e-6 at S = 1K..8K).
- bf16 / fp16: each output ``x`` is held to ``1.5 * sqrt(B) * max(e1, u * max|reference|)``, where
  ``e1`` is the error of one fused call of the same kernel over the whole sequence in the same dtype,
  ``u`` the unit roundoff (2**-8 bf16, 2**-11 fp16, 2**-24 for the fp32 lse) and ``B`` the most block
  partials summed into one row by this CP schedule: per key row for dk and dv, per query row for the
  rest (the sinks' gradient sums ``dout * out`` over rows whose ``out`` merged B partials). Rounding
  errors of B partials grow like sqrt(B); the premise of the GPU member tests.
"""
from __future__ import annotations

import torch

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
OUTPUTS = ("out", "lse", "dq", "dk", "dv", "dsink")
HALF = (torch.bfloat16, torch.float16)


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference; rows that are ``-inf`` in both (padding rows' lse) count as equal."""
    if got.shape != ref.shape:
        return float("inf")
    diff = torch.where(torch.isinf(ref) & (got == ref), torch.zeros_like(got), got - ref).abs()
    return float(diff.max()) if diff.numel() else 0.0


def _scale(ref: torch.Tensor) -> float:
    finite = ref[torch.isfinite(ref)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def full_precision_figures(result: dict, reference: dict, dtype: torch.dtype) -> dict:
    """``{output: {error, bound}}`` for fp64/fp32."""
    return {name: {"error": max_error(result[name], ref), "bound": TOL[dtype] * max(1.0, _scale(ref))}
            for name, ref in reference.items() if name in OUTPUTS}


def half_precision_figures(result: dict, fused: dict, reference: dict, dtype: torch.dtype) -> dict:
    """``{output: {error, fused_error, ratio, blocks, bound}}`` for bf16/fp16 (see the module docstring)."""
    q_blocks, k_blocks = result["blocks"]
    figures = {}
    for name, ref in reference.items():
        if name not in OUTPUTS:
            continue
        err, fused_err = max_error(result[name], ref), max_error(fused[name], ref)
        blocks = k_blocks if name in ("dk", "dv") else q_blocks  # dsink sums rows of the merged out
        u = UNIT_ROUNDOFF[torch.float32 if name == "lse" else dtype]
        bound = 1.5 * blocks ** 0.5 * max(fused_err, u * _scale(ref))
        figures[name] = {"error": err, "fused_error": fused_err, "ratio": err / fused_err if fused_err else None,
                         "blocks": blocks, "bound": bound}
    return figures


def failures(figures: dict) -> list[str]:
    """The outputs whose error exceeds its bound (NaN fails), described."""
    return [f"{name} error {f['error']:.2e} > bound {f['bound']:.2e}" for name, f in figures.items()
            if not f["error"] <= f["bound"]]
