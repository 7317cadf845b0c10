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
    ran: bool = True
    """False: the check could not run here (``passed``: the user accepted that with ``--allow-unchecked``)."""

    @property
    def verdict(self) -> str:
        if not self.ran:
            return "accepted" if self.passed else "NOT RUN"
        return "pass" if self.passed else "FAIL"


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
    lines += [f"{r.name:{width}s}  {r.verdict:6s}  {r.summary}" for r in results]
    return "\n".join(lines)


def _counts(results: Sequence[CheckResult]) -> tuple[int, int, int]:
    """Checks passed, failed, and not run (accepted or not)."""
    ran = [r for r in results if r.ran]
    passed = sum(r.passed for r in ran)
    return passed, len(ran) - passed, len(results) - len(ran)


def summary_line(results: Sequence[CheckResult]) -> str:
    """``selftest: N passed, M failed`` (``, K not run`` when a check could not run here)."""
    passed, failed, not_run = _counts(results)
    tail = ""
    if not_run:
        accepted = all(r.passed for r in results if not r.ran)
        tail = f", {not_run} not run" + (" (accepted with --allow-unchecked)" if accepted else "")
    return f"selftest: {passed} passed, {failed} failed{tail}"


def write_json(path: str, header: dict, results: Sequence[CheckResult]) -> None:
    passed, failed, not_run = _counts(results)
    doc = {**header, "passed": passed, "failed": failed, "not_run": not_run, "checks": [asdict(r) for r in results]}
    Path(path).write_text(json.dumps(_jsonable(doc), indent=1) + "\n", encoding="utf-8")
