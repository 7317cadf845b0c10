"""Switches read from the environment: ``0`` or ``1``, unset is the switch's default (or, for a ``setting``,
the caller's own rule), anything else refused naming it."""
from __future__ import annotations

import os
from typing import Optional


def setting(name: str, off: str, on: str, unset: str) -> Optional[bool]:
    """``True`` where ``name`` is ``1``, ``False`` where it is ``0``, None where it is unset; ``off``, ``on`` and
    ``unset`` say what each does, for the refusal of any other value."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r} must be 0 ({off}) or 1 ({on}); unset it for {unset}")
    return raw == "1"


def switch(name: str, off: str, on: str, default: bool = True) -> bool:
    """Whether ``name`` is on (``1``) or off (``0``), ``default`` where it is unset (``setting``)."""
    chosen = setting(name, off, on, f"the default, {int(default)} ({on if default else off})")
    return default if chosen is None else chosen
