"""On/off switches read from the environment: ``0`` or ``1``, unset is on, anything else refused naming it."""
from __future__ import annotations

import os


def switch(name: str, off: str, on: str) -> bool:
    """Whether ``name`` is on (``1`` or unset) or off (``0``); ``off`` and ``on`` say what each value does, for
    the refusal of any other value."""
    raw = os.environ.get(name, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r} must be 0 ({off}) or 1 ({on}, the default); unset it for the default")
    return raw == "1"
