"""The self-test's output: one row per check on stdout, every figure in ``--json``, and the last line
``selftest: N passed, M failed``."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence


@dataclass
class CheckResult:
    """One check: its name (``attention[causal] fp64``, ``boundaries.loss``...), verdict, one line for
    the table, and every figure behind it."""

    name: str
    passed: bool
    summary: str
    figures: dict = field(default_factory=dict)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def table(results: Sequence[CheckResult]) -> str:
    width = max([len(r.name) for r in results] + [5])
    lines = [f"{'check':{width}s}  result  details"]
    lines += [f"{r.name:{width}s}  {'pass' if r.passed else 'FAIL':6s}  {r.summary}" for r in results]
    return "\n".join(lines)


def summary_line(results: Sequence[CheckResult]) -> str:
    passed = sum(r.passed for r in results)
    return f"selftest: {passed} passed, {len(results) - passed} failed"


def write_json(path: str, header: dict, results: Sequence[CheckResult]) -> None:
    passed = sum(r.passed for r in results)
    doc = {**header, "passed": passed, "failed": len(results) - passed, "checks": [asdict(r) for r in results]}
    Path(path).write_text(json.dumps(_jsonable(doc), indent=1) + "\n", encoding="utf-8")
