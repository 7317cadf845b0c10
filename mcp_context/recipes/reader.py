"""Reading recipes: YAML files and dotted overrides into the schema, every value type-checked.

Owns the YAML reading (duplicate keys refused, naming the file and lines), the ``section.key=value``
overrides (values read as YAML), the type check of every value against its field's annotation,
unknown-key errors with a close-match suggestion, and the atomic save of a resolved recipe next to a
checkpoint. It does not check that the values make a runnable job: that is ``checks``.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Any, Iterable, List, Literal, Mapping, Sequence, Union

import yaml

from mcp_context.atomic import write_atomic
from mcp_context.recipes.schema import RecipeConfig, RecipeError

RESOLVED_RECIPE_FILENAME = "recipe.yaml"


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (list, List):
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Return ``value`` checked against ``annotation``; raise RecipeError naming ``key``."""
    origin = typing.get_origin(annotation)
    if origin is Union:
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except RecipeError as err:
                errors.append(err)
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise RecipeError(f"{key}={value!r} is not allowed: use one of {', '.join(map(repr, choices))}{hint}")
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{key}={value!r} must be a {_type_name(annotation)}, e.g. [2, 4]")
        (item_type,) = typing.get_args(annotation)
        return [_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"no reader for the annotation {annotation!r} of {key}")
    raise RecipeError(
        f"{key}={value!r} has type {type(value).__name__}, but {key} must be {_type_name(annotation)}"
    )


def _unknown_key_error(key: str, prefix: str, known: Iterable[str]) -> RecipeError:
    dotted = f"{prefix}{key}"
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return RecipeError(f"unknown recipe key {dotted!r}{hint}")


def _set_field(obj: Any, path: Sequence[str], value: Any, prefix: str = "") -> None:
    """Set the dotted ``path`` below dataclass ``obj`` to ``value``, type-checked."""
    hints = typing.get_type_hints(type(obj))
    key = path[0]
    if key not in hints:
        raise _unknown_key_error(key, prefix, hints)
    annotation = hints[key]
    dotted = f"{prefix}{key}"
    if dataclasses.is_dataclass(annotation):
        section = getattr(obj, key)
        if len(path) > 1:
            _set_field(section, path[1:], value, dotted + ".")
            return
        if value is None:  # a section whose keys are all commented out
            return
        if not isinstance(value, Mapping):
            raise RecipeError(f"{dotted} is a section: give it a mapping of keys, not {value!r}")
        for sub_key, sub_value in value.items():
            _set_field(section, [str(sub_key)], sub_value, dotted + ".")
        return
    if len(path) > 1:
        raise RecipeError(f"{dotted} is a value, not a section: '{dotted}.{'.'.join(path[1:])}' does not exist")
    setattr(obj, key, _coerce(value, annotation, dotted))


class _RecipeYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one
    silently, so a recipe could say ``steps: 10`` and train ``steps: 1000`` further down)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in first_line:
                raise RecipeError(
                    f"recipe {key_node.start_mark.name}: key {key!r} at line {line} repeats the key at line "
                    f"{first_line[key]} of the same section; keep one of them"
                )
            if isinstance(key, typing.Hashable):
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Union[str, os.PathLike]) -> Any:
    """The YAML document of a recipe file (duplicate keys refused, naming the file and lines)."""
    loader = _RecipeYamlLoader(Path(path).read_text(encoding="utf-8"))
    loader.name = str(path)  # marks (and so our messages) name the file
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"model.context_parallel_size=8"`` into (["model", "context_parallel_size"], 8).

    The value is read as YAML, so ``[2, 4]``, ``true``, ``null`` and numbers keep their types.
    """
    if "=" not in text:
        raise RecipeError(f"override {text!r} must look like section.key=value, e.g. train.steps=100")
    dotted, raw = text.split("=", 1)
    path = [p for p in dotted.strip().split(".")]
    if not all(path):
        raise RecipeError(f"override {text!r} has an empty key; write section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise RecipeError(f"override {text!r}: the value is not valid YAML ({err})") from None
    return path, value


def load_recipe(path: Union[str, os.PathLike, None] = None, overrides: Sequence[str] = ()) -> RecipeConfig:
    """Read a recipe: defaults (the tiny CPU recipe), then the YAML file, then dotted overrides.

    Every key is type-checked; unknown keys at any depth raise ``RecipeError`` with a suggestion.
    The result is not yet validated as a layout: call ``validate_recipe`` (the CLI and the pretrain
    entry do).
    """
    cfg = RecipeConfig()
    if path is not None:
        try:
            data = _read_yaml(path) or {}
        except yaml.YAMLError as err:
            raise RecipeError(f"recipe {path} is not valid YAML: {err}") from None
        if not isinstance(data, Mapping):
            raise RecipeError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
        for key, value in data.items():
            _set_field(cfg, [str(key)], value)
    for text in overrides:
        keys, value = parse_override(text)
        _set_field(cfg, keys, value)
    return cfg


def save_recipe(cfg: RecipeConfig, directory: Union[str, os.PathLike]) -> Path:
    """Write the resolved recipe as ``directory/recipe.yaml`` (temporary name, then rename)."""
    text = "# Resolved recipe (file + overrides), saved by mcp_context.recipes\n" + yaml.safe_dump(
        cfg.to_dict(), sort_keys=False, default_flow_style=None
    )
    return write_atomic(Path(directory) / RESOLVED_RECIPE_FILENAME, text.encode("utf-8"))
