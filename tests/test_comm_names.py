"""The communication scheme is a value: no code compares a comm name outside ``cp_rules.py``.

Reads the source of the package and the tools (``ast``): a comparison (``==``, ``!=``, ``in``, ``not in``)
with a string literal that is a ``cp_comm_type`` name or alias, or with a tuple/list/set of them, is a
rule restated at an edge; such a decision belongs in ``cp_rules.COMM_SCHEMES`` (look the rule up) so a
new scheme is one table row. Also: the table and its helpers agree.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mcp_context.cp_rules import COMM_ALIASES, COMM_SCHEMES, COMM_TYPES, a2a_degree, check_levels, normalize_comm

ROOT = Path(__file__).resolve().parents[1]
NAMES = set(COMM_TYPES) | set(COMM_ALIASES)


def _literals(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def comm_name_comparisons(path: Path) -> list[str]:
    """``file:line`` of every comparison against a comm-name literal in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if _literals(side) & NAMES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                    break
    return found


def test_no_comm_name_is_compared_outside_cp_rules():
    files = [p for p in sorted((ROOT / "mcp_context").rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py"))
             if p.name != "cp_rules.py"]
    offenders = [hit for p in files for hit in comm_name_comparisons(p)]
    assert not offenders, f"comm names compared outside cp_rules.py (look the rule up instead): {offenders}"


def test_the_checker_finds_a_planted_comparison(tmp_path):
    planted = ROOT / "tools" / "_planted_comm_check.py"
    try:
        planted.write_text("def f(comm):\n    return comm in ('p2p', 'x')\n")
        assert comm_name_comparisons(planted) == ["tools/_planted_comm_check.py:2"]
    finally:
        planted.unlink()


@pytest.mark.parametrize("name", list(COMM_SCHEMES))
def test_each_row_of_the_table_reads_the_same_through_every_helper(name):
    rule = COMM_SCHEMES[name]
    assert normalize_comm(name) == name
    assert all(normalize_comm(alias) == name for alias in rule.aliases)
    sizes = [2, 4]
    assert a2a_degree(name, sizes) == {"none": 1, "all": 8, "level0": 2}[rule.a2a]
    if rule.min_levels > 1:
        with pytest.raises(ValueError, match=f"needs hierarchical_context_parallel_sizes with at least "
                                             f"{rule.min_levels} levels"):
            check_levels(name, [8])
    check_levels(name, sizes)
