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


def _pid_and_threads(rank, world, groups: int):
    import os

    import torch.distributed as dist

    from tests._dist import _native_threads

    for _ in range(groups):  # kept by the pool: torch names such groups after their ranks
        dist.new_group([0, 1], use_local_synchronization=True)
    return os.getpid(), _native_threads()


def test_a_pool_whose_workers_gather_threads_is_replaced_after_the_case(monkeypatch):
    """Kept gloo groups hold polling threads: past MAX_WORKER_THREADS the pool is started afresh. The bound
    is lowered here to just above what a plain worker holds on this machine (5 threads on 2 cores, 19 on
    16: it grows with the cores), so that three kept groups (about 3 threads each) pass it."""
    from tests import _dist

    first = run_distributed(2, _pid_and_threads, 0)
    bound = max(threads for _, threads in first) + 4  # room for a thread or two a worker starts lazily
    assert bound <= _dist.MAX_WORKER_THREADS, (first, _dist.MAX_WORKER_THREADS)  # the default keeps a plain pool
    monkeypatch.setattr(_dist, "MAX_WORKER_THREADS", bound)
    again = run_distributed(2, _pid_and_threads, 0)
    assert [pid for pid, _ in again] == [pid for pid, _ in first]  # the same pool serves the next case
    assert all(threads <= bound for _, threads in again), (again, bound)
    grown = run_distributed(2, _pid_and_threads, 3)
    assert all(threads > bound for _, threads in grown), (grown, bound)
    fresh = run_distributed(2, _pid_and_threads, 0)
    assert not {pid for pid, _ in fresh} & {pid for pid, _ in grown}  # replaced after the growing case


def _rank(rank, world):
    return rank


def test_workers_exit_when_their_test_process_is_killed():
    """A test process killed outright (a timeout, ^C twice) runs no ``atexit``: its workers, children of the
    fork server, notice within ``OWNER_POLL_S`` and exit, as does the fork server then."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests._dist import OWNER_POLL_S, _alive

    script = ("import os, sys; sys.path.insert(0, os.getcwd()); from tests import _dist; "
              "from tests.test_dist_pool import _rank; _dist.run_distributed(2, _rank); "
              "print(*[p.pid for p in _dist._POOLS[2].procs], flush=True); sys.stdin.read()")
    root = str(Path(__file__).resolve().parents[1])
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        workers = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(workers) == 2 and all(map(_alive, workers))
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    deadline = time.monotonic() + OWNER_POLL_S + 10
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in workers if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived their killed test process"
