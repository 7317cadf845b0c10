"""The docs' commands work as written: every command of every ```bash block in README.md and docs/*.md.

The commands are read from the docs on each run, so an edited or added line is checked as it now
reads. Each one is parsed by its own command-line parser with the same arguments (argparse stopped
right after parsing: flags, values and choices as the CLI sees them); then

- cheap ones run for real in this process, through their CLI's ``main``: ``recipes show / validate``,
  ``megatron_lm`` (a recipe's Megatron-LM command); data preparation of the bundled corpus (into a temporary cache); the planner, restricted with ``--cp-sizes`` to the smallest CP sizes (the
  candidates of a full plan take minutes) and writing any ``--json`` under a temporary directory;
  the planner's step balance (``plan balance``) on the bundled corpus, tokenised into a temporary cache;
  ``--help`` of every converter sub-command used, which must list each flag the docs give it;
- commands that train, benchmark for minutes, need a GPU or a downloaded model are checked without
  running: the module or script exists, the arguments parse, and a recipe with its overrides loads
  and validates at the launch's world size (``torchrun --nproc-per-node``, read by torchrun's own
  parser);
- ``make TARGET`` must be a target (``make -n``), and the commands it would run are checked the same way;
- ``source .venv/bin/activate`` must name the environment ``make setup`` creates.

Then the README as a newcomer reads it: in a shell that holds only the README's set-up (a bare PATH,
then its set-up block), every program the docs call is the environment's, the commands of "Use" and
"Before a long run" run as written, the selftest prints the checks the README shows, and the "Use"
snippet, launched as the README says, matches plain attention.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TORCHRUN_PORT_ENV

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
    """The CLI's own ``parse_args`` (or ``parse_intermixed_args``: overrides on both sides of a flag) runs, then
    raises ``_Parsed`` with its namespace instead of returning."""
    originals = {name: getattr(argparse.ArgumentParser, name) for name in ("parse_args", "parse_intermixed_args")}

    def stopping(original):
        def parse(self, args=None, namespace=None):
            raise _Parsed(original(self, args, namespace))
        return parse

    for name, original in originals.items():
        setattr(argparse.ArgumentParser, name, stopping(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(argparse.ArgumentParser, name, original)


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
        # Looked up in a fresh interpreter: finding "pip" here would turn off setuptools' distutils shim
        # for this process, and a later import of megatron-core (via setuptools) would then fail.
        found = subprocess.run([sys.executable, "-c", f"import importlib.util, sys; "
                                f"sys.exit(importlib.util.find_spec({target!r}) is None)"], timeout=60)
        assert found.returncode == 0, f"no module {target}"
        return
    main = _main_of(target, is_module)
    ns = _parsed(main, args)
    name = target.replace("/", ".").removesuffix(".py")
    if name in ("mcp_context.recipes", "mcp_context.megatron_lm"):
        status, out, err = _call(main, args)
        assert status == 0, err
        assert out.strip()
    elif name in ("mcp_context.plan", "tools.plan") and getattr(ns, "command", None) == "balance":
        status, out, err = _call(main, args + [f"data.cache_dir={tmp_path}"])  # the corpus tokenised afresh
        assert status == 0, err
        assert "max/mean" in out
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
    elif program == "source":  # the set-up's activation: the environment make setup creates
        assert len(argv) == 2 and Path(argv[1]).parts[1:] == ("bin", "activate"), argv
        dry = subprocess.run(["make", "-n", "-B", "setup"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert f"-m venv {Path(argv[1]).parts[0]}" in dry.stdout, dry.stdout
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


# The README as a newcomer reads it.
README = ROOT / "README.md"
RUN_SECTIONS = ("## Use", "## Before a long run")
"""README sections whose commands run for real in the set-up shell (the GPU section's are for a CUDA
environment, the make targets are ``make test`` itself or minutes of training)."""


def _section(heading: str) -> str:
    """The README's text under the heading that starts with ``heading``, up to the next heading."""
    text = README.read_text(encoding="utf-8")
    start = re.search(rf"^{re.escape(heading)}.*$", text, re.M)
    assert start, f"README.md has no section {heading!r}"
    rest = text[start.end():]
    return rest[:rest.find("\n## ")] if "\n## " in rest else rest


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of each fenced block of ``text``, in order."""
    blocks, lang, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _venv() -> Path:
    """The environment the README's set-up makes: the checkout's ``.venv``, else the virtualenv running
    this suite (a checkout whose environment lives elsewhere)."""
    if (ROOT / ".venv" / "bin" / "activate").is_file():
        return ROOT / ".venv"
    if sys.prefix != sys.base_prefix and (Path(sys.prefix) / "bin" / "activate").is_file():
        return Path(sys.prefix)
    pytest.skip("this suite runs outside a virtualenv; the README's set-up (make setup) makes .venv")


def _set_up_shell(command: str, timeout: float) -> subprocess.CompletedProcess:
    """``command`` run by bash at the checkout with nothing but the README's set-up: a bare PATH, then the
    lines of the set-up block after ``make`` (which built ``_venv()``). PYTHONPATH names this checkout,
    as the editable install of ``make setup`` does, in case the environment was installed from another."""
    venv = _venv()
    set_up = [shlex.join(argv) for _, argv in bash_commands(_section("## Set up")) if argv[0] != "make"]
    assert set_up, "the README's set-up block has no line after make setup"
    if venv != ROOT / ".venv":
        set_up = [line.replace(".venv/", f"{venv}/") for line in set_up]
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": str(ROOT)}
    if TORCHRUN_PORT_ENV in os.environ:  # this pytest worker's rendezvous port (tests/conftest.py)
        env[TORCHRUN_PORT_ENV] = os.environ[TORCHRUN_PORT_ENV]
    return subprocess.run(["bash", "-c", " && ".join([f"cd {shlex.quote(str(ROOT))}", *set_up, command])], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_every_documented_program_is_the_set_up_environments():
    programs = sorted({Path(argv[0]).name for p in _doc_commands() for argv in p.values} - {"make", "source"})
    done = _set_up_shell("command -v " + " ".join(programs), timeout=60)
    assert done.returncode == 0, f"not found after the README's set-up: {programs}; {done.stdout}{done.stderr}"
    found = done.stdout.split()
    assert [Path(f).parent for f in found] == [_venv() / "bin"] * len(programs), dict(zip(programs, found))


def _readme_run_commands() -> list:
    return [pytest.param(argv, id=" ".join(argv)[:70]) for heading in RUN_SECTIONS
            for _, argv in bash_commands(_section(heading))]


def _report(output: str) -> list[str]:
    """A selftest's report without its figures (they vary with the machine): the title, each check's
    name and result, the summary."""
    lines = output.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if re.match(r"check +result +details$", line))
    column = lines[header].index("result")
    rows = [lines[header - 1]]
    for line in lines[header + 1:]:
        rows.append(line if line.startswith("selftest: ") else f"{line[:column].strip()} {line[column:].split()[0]}")
        if line.startswith("selftest: "):
            break
    return rows


@pytest.mark.parametrize("argv", _readme_run_commands())
def test_readme_command_runs_as_written_after_the_set_up(argv):
    done = _set_up_shell(shlex.join(argv), timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    if "mcp_context.selftest" in argv:
        assert re.search(r"^selftest: \d+ passed, 0 failed$", done.stdout, re.M), done.stdout[-2000:]
    if argv[0] == "torchrun" and "mcp_context.selftest" in argv:  # the README shows this one's report
        [shown] = [body for lang, body in _fenced_blocks(_section("## Before a long run")) if not lang]
        assert _report(done.stdout) == _report(shown), done.stdout


def test_readme_use_snippet_matches_plain_attention_under_torchrun(tmp_path):
    """The "Use" snippet as the README launches it (``torchrun --nproc-per-node 4 use.py``), with a check
    inserted before its closing ``destroy_process_group``: every output gathered, unsharded and compared
    with plain attention over the full sequence (a causal, a windowed and a packed-document mask)."""
    [snippet] = [body for lang, body in _fenced_blocks(_section("## Use")) if lang == "python"]
    launch = re.search(r"runs as `(torchrun [^`]+ use\.py)`", _section("## Use"))
    assert launch and snippet.rstrip().endswith("dist.destroy_process_group()"), "the Use section changed shape"
    body = snippet.rstrip().removesuffix("dist.destroy_process_group()")
    (tmp_path / "use.py").write_text(body + _USE_CHECK + "dist.destroy_process_group()\n")
    done = _set_up_shell(f"cd {shlex.quote(str(tmp_path))} && {launch.group(1)}", timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    errors = dict(re.findall(r"^(\w+) max error (\S+)$", done.stdout, re.M))
    assert set(errors) == {"out", "out_window", "out_packed"}, done.stdout
    assert all(float(e) <= 5e-6 for e in errors.values()), errors  # fp32 (seen: <= 4.8e-7)


_USE_CHECK = """
# Inserted by tests/test_docs_commands.py: each output against plain attention over the full sequence.
import torch.nn.functional as F
from mcp_context import unshard_sequence

i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
document = torch.bucketize(torch.arange(s), cu_seqlens[1:], right=True)
allowed = {"out": j <= i, "out_window": (j <= i) & (j >= i - 15),
           "out_packed": (j <= i) & (document[:, None] == document[None, :])}
layout = {"out": ("zigzag", None), "out_window": ("zigzag", None), "out_packed": ("balanced", cu_seqlens)}
qh, kh, vh = (x.permute(1, 2, 0, 3) for x in (q_full, k_full, v_full))  # [b, heads, s, d]
kh, vh = (x.repeat_interleave(h // h_kv, dim=1) for x in (kh, vh))
for name, mask in allowed.items():
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, globals()[name])
    full = unshard_sequence(shards, layout[name][0], 0, layout[name][1])
    plain = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).permute(2, 0, 1, 3)  # [s, b, h, d]
    if rank == 0:
        print(f"{name} max error {(full.reshape(plain.shape) - plain).abs().max().item():.1e}")
dist.barrier()  # rank 0 printed after the last gather: no rank tears gloo down under a peer still reading
"""
