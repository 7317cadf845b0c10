"""``to-megatron-args`` prints a command that runs as printed: a local-impl recipe turns off the
fusions that need Transformer Engine or apex, and a split Megatron-LM's dataset builder would loop
on is refused (empty train/valid) or adjusted with a note (empty test). (That the Megatron-LM
translation sits above ``data``, which sits above ``recipes``, is tests/test_layering.py's check.)
"""
from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from mcp_context.megatron_lm import LOCAL_IMPL_FLAGS, format_megatron_command, megatron_split
from mcp_context.recipes import RecipeError, load_recipe, validate_recipe
from mcp_context.recipes.__main__ import main as recipes_cli
from tests.test_recipes import _command_argv, _megatron_lm_parser

REPO = Path(__file__).resolve().parent.parent


def _parsed(command: str):
    return _megatron_lm_parser().parse_args(shlex.split(_command_argv(command)))


def test_local_recipe_command_runs_without_te_or_apex(capsys):
    assert recipes_cli(["to-megatron-args", str(REPO / "recipes" / "tiny_cpu.yaml")]) == 0
    command = capsys.readouterr().out
    a = _parsed(command)
    assert a.transformer_impl == "local" and a.spec == ["mcp_context.megatron.specs", "hcp_local_spec"]
    assert (a.apply_rope_fusion, a.persist_layer_norm, a.gradient_accumulation_fusion) == (False, False, False)
    # The bundled corpus has 236 scenes: 949,50,1 leaves the test split empty, so the test weight goes.
    assert a.split == "949,50,0"
    assert ("# data.split='949,50,1' leaves the test split of" in command and "(236 documents) empty" in command
            and "printed --split 949,50,0 (no test set)" in command)


def test_te_recipe_keeps_megatron_lm_fusions():
    cfg = load_recipe(REPO / "recipes" / "llama3_8b_128k_hcp.yaml")
    command = format_megatron_command(cfg)
    a = _parsed(command)
    assert a.transformer_impl == "transformer_engine" and a.apply_rope_fusion and a.gradient_accumulation_fusion
    assert not any(flag in command for flag in LOCAL_IMPL_FLAGS)
    assert a.split == cfg.data.split == "99,1,0"  # data on the cluster: document counts unknown, split as given


@pytest.mark.parametrize("split, name", [("999,1,0", "valid"), ("1,999,0", "train")])
def test_a_split_with_an_empty_train_or_valid_set_is_refused(split, name, capsys):
    cfg = load_recipe(None, [f"data.split={split}"])
    with pytest.raises(RecipeError, match=rf"data.split='{split}' leaves the {name} split of .* \(236 documents\) "
                                          rf"with no document, which megatron-core's dataset builder loops on forever"):
        megatron_split(cfg)
    assert recipes_cli(["to-megatron-args", "-", f"data.split={split}"]) == 2
    assert f"error: data.split='{split}' leaves the {name} split" in capsys.readouterr().err


def test_a_split_with_documents_everywhere_is_printed_unchanged():
    cfg = load_recipe(None, ["data.split=90,8,2"])
    assert megatron_split(cfg) == ("90,8,2", None)
    assert _parsed(format_megatron_command(cfg)).split == "90,8,2"




def test_a_float_rotary_base_prints_as_megatron_lms_integer_or_is_refused():
    """``model.rotary_base`` takes a float (a converted model's ``rope_theta``); Megatron-LM's
    ``--rotary-base`` takes an integer, so a whole float prints as one and a fraction is refused."""
    a = _parsed(format_megatron_command(load_recipe(None, ["model.rotary_base=5.0e+5"])))
    assert a.rotary_base == 500000
    with pytest.raises(RecipeError, match=r"model.rotary_base=10000.5 has no Megatron-LM spelling"):
        format_megatron_command(load_recipe(None, ["model.rotary_base=10000.5"]))


def test_a_sliding_window_recipe_prints_megatron_lms_window_size():
    """``model.window_size`` reaches Megatron-LM as ``--window-size left,right`` (its ``tuple_type``)."""
    cfg = load_recipe(None, ["model.window_size=[63, 0]"])
    validate_recipe(cfg)
    assert _parsed(format_megatron_command(cfg)).window_size == (63, 0)
    assert _parsed(format_megatron_command(load_recipe(None))).window_size is None


def _megatron_lm_freq(x: str):
    """Megatron-LM's ``moe_freq_type`` (``--window-attn-skip-freq``'s parser): an int, or a list
    expression of digits, commas, brackets, parentheses, ``+`` and ``*`` only, which it evaluates
    (a plain list literal here)."""
    if "[" not in x:
        return int(x)
    assert not re.search(r"[^,\d\[\]\(\)\+\*]", x), f"Megatron-LM refuses the pattern {x!r}"
    return ast.literal_eval(x)


@pytest.mark.parametrize("freq", [2, [0, 1]])
def test_window_attn_skip_freq_prints_as_megatron_lms_flag(freq):
    """``model.window_attn_skip_freq`` reaches Megatron-LM as ``--window-attn-skip-freq``: an int as
    it is, a list as the list expression its parser evaluates (no spaces, which it refuses)."""
    cfg = load_recipe(None, ["model.window_size=[7, 0]", f"model.window_attn_skip_freq={freq}"])
    validate_recipe(cfg)
    parser = _megatron_lm_parser()
    parser.add_argument("--window-attn-skip-freq", type=_megatron_lm_freq, default=None)
    args = parser.parse_args(shlex.split(_command_argv(format_megatron_command(cfg))))
    assert (args.window_size, args.window_attn_skip_freq) == ((7, 0), freq)
    assert "--window-attn-skip-freq" not in format_megatron_command(load_recipe(None, ["model.window_size=[7, 0]"]))
