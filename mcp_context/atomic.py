"""Atomic file writes: a reader (or a resumed run after a crash) sees the old file or the new one,
never a partial one. The one writer every module that saves a small file uses (recipes, metrics,
``latest`` pointers, tokenizers, planner and benchmark JSON). Directories that must appear whole
(checkpoints) are staged and renamed by their own writers.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union


def write_atomic(path: Union[str, os.PathLike], data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename, so a
    reader never sees a partial file. The file gets the usual permissions (0666 less the umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
