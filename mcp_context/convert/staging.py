"""Output directories that appear complete or not at all.

Every converter output is written into a hidden ``.NAME.partial`` sibling and renamed to ``NAME``
only when complete (``os.replace``), so a crash or an error never leaves a half-written checkpoint
under the name a user would load. An existing output is never overwritten.
"""
from __future__ import annotations

import shutil
from pathlib import Path


def staging_dir(final_dir: Path) -> Path:
    """The temporary sibling a checkpoint is written into before being renamed to ``final_dir``."""
    return final_dir.parent / f".{final_dir.name}.partial"


def prepare_staging_dir(final_dir: Path) -> Path:
    """Refuse to overwrite ``final_dir``; create (or clear a stale) staging directory and return it."""
    if final_dir.exists():
        raise FileExistsError(f"output {final_dir} already exists; choose a new directory or remove it first")
    tmp = staging_dir(final_dir)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp
