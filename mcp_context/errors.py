"""An exception named in one line, as reports, warnings and refusals quote it."""
from __future__ import annotations

from typing import Optional


def first_line(err: BaseException, limit: Optional[int] = None) -> str:
    """``Type: the message's first line`` (cut at ``limit`` characters, if given): enough to tell failures apart
    in a table or a warning without a traceback."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:limit] if text else ''}"
