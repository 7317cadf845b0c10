"""The test pool itself: a case that failed only because gloo could not connect a group runs once more on
a fresh pool; a case that fails for any other reason is reported at once, not run again."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests._dist import run_distributed


def _fails_first(rank, world, directory, message):
    runs = Path(directory) / f"rank{rank}"
    with runs.open("a") as f:
        f.write("run\n")
    if len(runs.read_text().splitlines()) == 1:
        raise RuntimeError(message)
    return rank


def test_a_gloo_connection_failure_runs_the_case_again_on_a_fresh_pool(tmp_path):
    message = "Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [127.0.0.1]:5"
    assert run_distributed(2, _fails_first, str(tmp_path), message) == [0, 1]
    assert [len((tmp_path / f"rank{r}").read_text().splitlines()) for r in (0, 1)] == [2, 2]


def test_any_other_failure_is_reported_without_running_again(tmp_path):
    with pytest.raises(AssertionError, match=r"(?s)rank 0 raised:.*RuntimeError: the case.s own failure"):
        run_distributed(2, _fails_first, str(tmp_path), "the case's own failure")
    assert [len((tmp_path / f"rank{r}").read_text().splitlines()) for r in (0, 1)] == [1, 1]
