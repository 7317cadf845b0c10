"""The docs' commands work as written: every command of every ```bash block in README.md and docs/*.md.

The commands are read from the docs on each run, so an edited or added line is checked as it now
reads. Each one is parsed by its own command-line parser with the same arguments (argparse stopped
right after parsing: flags, values and choices as the CLI sees them); then

- cheap ones run for real in this process, through their CLI's ``main``: ``recipes show / validate``,
  ``megatron_lm`` (a recipe's Megatron-LM command); data preparation of the bundled corpus (into a temporary cache); the planner, restricted with ``--cp-sizes`` to the smallest CP sizes (the
  candidates of a full plan take minutes) and writing any ``--json`` under a temporary directory;
  ``--help`` of every converter sub-command used, which must list each flag the docs give it;
- commands that train, benchmark for minutes, need a GPU or a downloaded model are checked without
  running: the module or script exists, the arguments parse, and a recipe with its overrides loads
  and validates at the launch's world size (``torchrun --nproc-per-node``, read by torchrun's own
  parser);
- ``make TARGET`` must be a target (``make -n``), and the commands it would run are checked the same way.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def bash_commands(text: str) -> list[tuple[int, list[str]]]:
    """``(line, argv)`` of every command in the ```bash blocks of ``text`` (continuations joined,
    comments dropped)."""
    commands, block, pending, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            block = not block and line.strip() == "```bash"
            continue
        if not block:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        argv = shlex.split(pending + line, comments=True)
        pending = ""
        if argv:
            commands.append((start, argv))
    return commands


def _doc_commands() -> list:
    params = []
    for path in DOCS:
        for line, argv in bash_commands(path.read_text(encoding="utf-8")):
            where = f"{path.relative_to(ROOT)}:{line}"
            params.append(pytest.param(argv, id=f"{where} {' '.join(argv)[:60]}"))
    return params


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


@contextlib.contextmanager
def _stop_after_parsing():
    """The CLI's own ``parse_args`` runs, then raises ``_Parsed`` with its namespace instead of returning."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def _call(main, argv: list[str]) -> tuple[int, str, str]:
    """Run a CLI's ``main(argv)`` here; exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code
    return status or 0, out.getvalue(), err.getvalue()


def _parsed(main, argv: list[str]) -> argparse.Namespace:
    with _stop_after_parsing():
        try:
            status, _, err = _call(main, argv)
        except _Parsed as parsed:
            return parsed.namespace
    pytest.fail(f"the arguments {argv} do not parse (exit {status}): {err.strip()}")


def _main_of(target: str, is_module: bool):
    """The ``main`` that ``python -m target`` or ``python target`` runs."""
    if is_module:
        assert importlib.util.find_spec(target) is not None, f"no module {target}"
        entry = importlib.import_module(f"{target}.__main__" if importlib.util.find_spec(f"{target}.__main__")
                                        else target)
    else:
        path = ROOT / target
        assert path.is_file(), f"no script {target}"
        spec = importlib.util.spec_from_file_location(f"_docs_{path.stem}", path)
        entry = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = entry  # dataclasses look their module up while the script loads
        spec.loader.exec_module(entry)
    assert callable(getattr(entry, "main", None)), f"{target} has no main()"
    return entry.main


def _check_recipe(recipe, overrides: list[str], world_size=None) -> None:
    from mcp_context.recipes import load_recipe, validate_recipe

    validate_recipe(load_recipe(None if recipe in (None, "-") else recipe, overrides), world_size=world_size)


def _bundled_corpus(ns: argparse.Namespace) -> bool:
    from mcp_context.recipes import load_recipe

    data = load_recipe(None if ns.recipe == "-" else ns.recipe, ns.overrides).data
    return data.corpus == "bundled" and not data.data_path


def _check_python(argv: list[str], tmp_path: Path, world_size=None) -> None:
    """``argv`` after ``python``: ``-m module args`` or ``script.py args``."""
    is_module = argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if is_module else (argv[0], argv[1:])
    if is_module and not target.startswith("mcp_context"):  # a tool, e.g. pytest: it exists
        assert importlib.util.find_spec(target) is not None, f"no module {target}"
        return
    main = _main_of(target, is_module)
    ns = _parsed(main, args)
    name = target.replace("/", ".").removesuffix(".py")
    if name in ("mcp_context.recipes", "mcp_context.megatron_lm"):
        status, out, err = _call(main, args)
        assert status == 0, err
        assert out.strip()
    elif name in ("mcp_context.plan", "tools.plan"):
        from mcp_context.plan.__main__ import _request
        from mcp_context.plan.candidates import cp_sizes_for

        req = _request(ns)
        smallest = cp_sizes_for(req.gpus, req.tp, req.pp)[:2]
        if "--json" in args:
            i = args.index("--json") + 1
            args = args[:i] + [str(tmp_path / Path(args[i]).name)] + args[i + 1:]
        status, out, err = _call(main, args + ["--cp-sizes", *map(str, smallest), "--no-progress"])
        assert status == 0, err
        assert "recommended:" in out
    elif name == "mcp_context.convert":
        status, out, _ = _call(main, [ns.command, "--help"])
        assert status == 0
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            assert flag in out, f"{flag} is not a flag of convert {ns.command}"
    elif name in ("mcp_context.data", "tools.prepare_data") and _bundled_corpus(ns):
        status, out, err = _call(main, args + [f"data.cache_dir={tmp_path}"])
        assert status == 0, err
        assert "documents" in out
    elif hasattr(ns, "recipe") and hasattr(ns, "overrides"):  # training, your own corpus: the recipe validates
        _check_recipe(ns.recipe, ns.overrides, world_size)


def _check(argv: list[str], tmp_path: Path) -> None:
    program = Path(argv[0]).name
    if program == "make":
        target = argv[1]
        dry = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert dry.returncode == 0, f"make {target}: {dry.stderr.strip()}"
        for _, inner in bash_commands(f"```bash\n{dry.stdout}\n```"):
            if Path(inner[0]).name in ("python", "python3", "torchrun") and inner[1:]:
                _check(inner, tmp_path)
    elif program == "torchrun":
        from torch.distributed.run import get_args_parser

        launch = get_args_parser().parse_args(argv[1:])
        nodes = int(str(launch.nnodes).split(":")[-1])
        world = int(launch.nproc_per_node) * nodes
        script = (["-m"] if launch.module else []) + [launch.training_script, *launch.training_script_args]
        _check_python(script, tmp_path, world_size=world)
    elif re.fullmatch(r"python3?", program):
        _check_python(argv[1:], tmp_path)
    else:
        pytest.fail(f"no check for the program {argv[0]!r}: teach tests/test_docs_commands.py how to check it")


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs' paths (recipes/..., tools/...) are relative to the checkout


@pytest.mark.parametrize("argv", _doc_commands())
def test_documented_command_works_as_written(argv, tmp_path):
    _check(argv, tmp_path)


def test_every_doc_block_is_found():
    """The extraction sees the commands the docs are known to hold (continuations joined, comments dropped)."""
    text = "```bash\npython -m a --x 1 \\\n    --y 'p q'   # note\n# only a comment\n```\n```python\nx = 1\n```\n"
    assert bash_commands(text) == [(2, ["python", "-m", "a", "--x", "1", "--y", "p q"])]
    programs = {Path(argv[0]).name for p in _doc_commands() for argv in p.values}
    assert {"make", "torchrun", "python"} <= programs
