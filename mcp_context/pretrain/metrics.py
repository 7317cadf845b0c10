"""Per-step metrics: ``RUN_DIR/metrics.jsonl`` (one JSON object per step) and what the user sees:
a progress bar on a terminal, one plain line per log interval otherwise (a cluster's log file).

Each line holds at least ``step``, ``loss`` (mean over every valid token of the step's global batch,
the same on every rank), ``lr``, ``grad_norm`` (before clipping), ``tokens_per_s`` and
``step_time_s``; evaluation steps add ``val_loss``. Written by rank 0 only, one ``write`` of the
whole line and its newline per step, flushed: the newline marks a complete record, so a line that a
crash cut short (no newline) is recognised as torn. A resumed run first drops a torn last line and
the lines of steps after its checkpoint (rewritten under a temporary name), so the file always
describes one continuous run.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional, TextIO

from mcp_context.atomic import write_atomic


class MetricsFileError(ValueError):
    """A ``metrics.jsonl`` line that is complete but not a step record; the message names file:line."""


def read_metrics_lines(path: os.PathLike | str) -> tuple[list[dict], bytes]:
    """The complete records of a ``metrics.jsonl`` file, in order, and the torn last line (b"" if none).

    A record is complete when its newline was written; the text after the last newline is what a
    crash cut short. A complete line that is not a JSON object with a ``step`` raises
    ``MetricsFileError`` naming ``path:line``.
    """
    data = Path(path).read_bytes()
    complete, _, torn = data.rpartition(b"\n")
    records = []
    for number, line in enumerate(complete.split(b"\n") if complete else [], start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            raise MetricsFileError(f"{path}:{number}: not a JSON record ({err}); delete or repair that line") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise MetricsFileError(f"{path}:{number}: a record without an integer 'step'; delete or repair that line")
        records.append(record)
    return records, torn


def read_metrics(path: os.PathLike | str) -> list[dict]:
    """The complete records of a ``metrics.jsonl`` file, in order (a torn last line left out)."""
    return read_metrics_lines(path)[0]


def log_line(record: dict, total_steps: int) -> str:
    """One step as a plain log line, e.g. ``step 10/300 | loss 4.1234 | lr 2.94e-03 | 5123 tokens/s |
    0.210 s/step`` (`` | val_loss 4.2000`` on evaluation steps)."""
    line = (f"step {record['step']}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"{record['tokens_per_s']:.0f} tokens/s | {record['step_time_s']:.3f} s/step")
    return line + (f" | val_loss {record['val_loss']:.4f}" if "val_loss" in record else "")


class MetricsLog:
    """Appends step records to ``path`` and shows them on ``stream`` (default stdout; ``enabled`` on
    rank 0 only, shown only with ``progress``).

    On a terminal a tqdm bar advances every step, its loss and tokens/s refreshed every
    ``refresh_interval`` steps (the recipe's ``logging.log_interval``) and at evaluations. Elsewhere
    (a scheduler's log file, where a bar's carriage returns make one endless line) one plain
    ``log_line`` is printed every ``refresh_interval`` steps and at evaluations, as Megatron-LM does
    per ``--log-interval``. ``notes``: what opening the file found (a torn last line dropped), for
    the caller to show.
    """

    def __init__(self, path: os.PathLike | str, first_step: int, total_steps: int, enabled: bool,
                 progress: bool = True, refresh_interval: int = 1, stream: Optional[TextIO] = None):
        self.path = Path(path)
        self.enabled = enabled
        self.refresh_interval = refresh_interval
        self.total_steps = total_steps
        self.notes: list[str] = []
        self._stream = stream if stream is not None else sys.stdout
        self._lines = False
        self._file = None
        self._bar = None
        if not enabled:
            return
        if self.path.exists():
            records, torn = read_metrics_lines(self.path)
            if torn:
                self.notes.append(f"dropped the torn last line of {self.path} ({len(torn)} bytes a crash cut short)")
            kept = [r for r in records if r["step"] <= first_step]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode("utf-8"))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")
        if progress and self._stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=first_step, desc="train", unit="step", dynamic_ncols=True,
                             file=self._stream)
        else:
            self._lines = progress

    def log(self, record: dict) -> None:
        """Write one step's record; advance the bar, or print its line when one is due."""
        if not self.enabled:
            return
        self._file.write((json.dumps(record) + "\n").encode("utf-8"))
        self._file.flush()
        due = record["step"] % self.refresh_interval == 0 or "val_loss" in record
        if self._lines and due:
            print(log_line(record, self.total_steps), file=self._stream, flush=True)
        if self._bar is None:
            return
        if due:
            postfix = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
            if "val_loss" in record:
                postfix["val"] = f"{record['val_loss']:.4f}"
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    def note(self, text: str) -> None:
        """A line for the user (above the bar), rank 0 only."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        self._file = self._bar = None
