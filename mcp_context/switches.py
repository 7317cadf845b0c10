"""On/off switches read from the environment: ``0`` or ``1``, unset is the switch's default, anything else
refused naming it."""
from __future__ import annotations

import os


def switch(name: str, off: str, on: str, default: bool = True) -> bool:
    """Whether ``name`` is on (``1``) or off (``0``), ``default`` where it is unset; ``off`` and ``on`` say what
    each value does, for the refusal of any other value."""
    raw = os.environ.get(name, "1" if default else "0")
    if raw not in ("0", "1"):
        what = {"0": f"0 ({off}", "1": f"1 ({on}"}
        what["1" if default else "0"] += ", the default"
        raise ValueError(f"{name}={raw!r} must be {what['0']}) or {what['1']}); unset it for the default")
    return raw == "1"
