"""Persistent pools of gloo worker processes for multi-process tests.

Starting torch (and megatron-core) in a fresh process costs seconds on a 2-core machine, so each world
size gets one pool of workers per pytest session, and every case reuses it (~0.1 s a case). On a machine
without a CUDA device workers are forked from a fork server that has imported torch and megatron-core once
(``PRELOAD``): a pool of 4 starts and runs its first megatron-core case in 0.1 s, where spawned workers took
7-8 s (16.8 s cold), and a run starts some twenty pools (replaced pools below included). With a CUDA device
they are spawned (``_context``).
A case is a module-level function ``fn(rank, world_size, *args)``; it runs in every worker with the
default gloo process group initialised, and its return values come back as a list indexed by rank.

A case that raises, or that does not answer within its timeout (a hang in a collective), tears its
pool down: the next case starts a fresh one, so one broken case cannot wedge the rest of the suite.
A case that failed only because gloo could not connect a new group (seen rarely in full runs on the
busy 2-core machine: "Gloo connectFullMesh failed ... Connection closed by peer") runs once more on a
fresh pool; every other failure is reported as it happened. A worker whose test process is gone (killed by
a timeout or by hand, so no ``atexit`` ran) exits within ``OWNER_POLL_S``: its fork server outlives the
test process, and orphaned workers once idled on in the dozens, slowing whatever ran next.
Every process group a case creates (megatron-core's ``initialize_model_parallel`` makes dozens and
its ``destroy_model_parallel`` drops them without destroying them) is destroyed when the case ends:
each gloo group keeps native threads, and hundreds of cases would otherwise pile up thousands. Groups
made with ``use_local_synchronization`` are kept: torch names them after their ranks, so a destroyed
one's rendezvous keys would be found by its successor; a pool whose workers have gathered more than
``MAX_WORKER_THREADS`` native threads is replaced after its case. The grids take their hierarchies
from ``hcp_groups``, built once per worker and kept.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

_POOLS: dict[int, "_Pool"] = {}
PRELOAD = ["torch", "torch.distributed", "megatron.core"]
"""What the fork server imports before forking workers (a module that is not installed is skipped)."""
# A worker whose native threads pass this is replaced after its case: gloo groups a case keeps (those
# made with use_local_synchronization) hold threads that poll, and idle pools of a few hundred threads
# per worker were seen to take a whole core from the tests that followed. A plain worker's count grows
# with the cores it may use (5 threads on 2 cores, 19 on 16), so the bound does too.
MAX_WORKER_THREADS = 96 + len(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1))
_GRACE_S = 10.0
OWNER_POLL_S = 2.0
"""How often an idle worker checks that its test process still runs."""
# gloo failing to connect a new group's ranks (a peer's socket closed while the mesh formed): the
# machine's, not the case's; the case runs once more on a fresh pool.
_TRANSPORT_FAILURES = ("Gloo connectFullMesh failed",)


class TransportFailure(AssertionError):
    """A case failed because gloo could not connect a group, not because of what it checks."""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):  # gone, or its number reused by another user's process
            return False
        return True


def _next_task(tasks: Any, owner: int) -> Any:
    """The next task; exits the worker at once where the test process ``owner`` is gone."""
    while True:
        try:
            return tasks.get(timeout=OWNER_POLL_S)
        except queue.Empty:
            if not _alive(owner):
                os._exit(0)  # nothing to report to; no gloo teardown that could wait on dead peers


def _worker(rank: int, world_size: int, init_file: str, tasks: Any, results: Any, owner: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    created: list = []
    new_group = dist.new_group

    def recording_new_group(*args, **kwargs):
        group = new_group(*args, **kwargs)
        if not kwargs.get("use_local_synchronization") and not _keeping:  # those are named by their ranks
            created.append(group)
        return group

    dist.new_group = recording_new_group
    while True:
        task = _next_task(tasks, owner)
        if task is None:
            break
        fn, args = task
        try:
            ok, payload = True, fn(rank, world_size, *args)
        except BaseException:  # report everything, including assertion failures, to the test process
            ok, payload = False, traceback.format_exc()
        for group in created:
            with contextlib.suppress(ValueError):  # a group this rank is not in, or one already destroyed
                dist.destroy_process_group(group)
        created.clear()
        results.put((rank, ok, payload, _native_threads()))
    dist.destroy_process_group()


_KEPT: dict[tuple, Any] = {}  # in a worker: the hierarchies hcp_groups built, kept for the pool's life
_keeping = False  # True while hcp_groups builds: its groups are not destroyed after the case


def hcp_groups(sizes) -> Any:
    """``build_hcp_groups(sizes)`` over the world, built once per pool worker and kept, as a training
    job builds its groups once: every case runs on every rank in the same order, so the ranks ask for
    the same hierarchies in the same order. Cases that test group building call ``build_hcp_groups``."""
    global _keeping
    key = tuple(sizes)
    if key not in _KEPT:
        from mcp_context import build_hcp_groups

        _keeping = True
        try:
            _KEPT[key] = build_hcp_groups(list(sizes))
        finally:
            _keeping = False
    return _KEPT[key]


def _native_threads() -> int:
    """This process's native threads (gloo's included; 0 where /proc is absent)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


class _Pool:
    def __init__(self, world_size: int):
        ctx = _context()
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix="mcp_pool_")
        init_file = os.path.join(self._dir.name, "init")
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, self.tasks[r], self.results, os.getpid()),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple, timeout: float) -> list:
        for q in self.tasks:
            q.put((fn, args))
        out: list = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        most_threads = 0
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            try:
                rank, ok, payload, threads = self.results.get(timeout=1.0)
                most_threads = max(most_threads, threads)
            except queue.Empty:
                dead = [r for r in pending if not self.procs[r].is_alive()]
                if dead:
                    errors.update({r: f"worker died (exit code {self.procs[r].exitcode})" for r in dead})
                    pending.difference_update(dead)
                continue
            pending.discard(rank)
            if ok:
                out[rank] = payload
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + _GRACE_S)  # others may be stuck in a collective
        if errors or pending:
            self.close(force=True)
            lines = [f"rank {r} raised:\n{tb}" for r, tb in sorted(errors.items())]
            if pending:
                lines.append(f"ranks {sorted(pending)} did not finish {fn.__name__} "
                             f"(timeout {timeout:.0f} s, or {_GRACE_S:.0f} s after another rank failed)")
            failure = TransportFailure if any(s in tb for tb in errors.values() for s in _TRANSPORT_FAILURES) \
                else AssertionError
            raise failure(f"distributed case {fn.__name__} failed (world size {self.world_size}):\n" + "\n".join(lines))
        if most_threads > MAX_WORKER_THREADS:  # kept groups' threads poll even while the pool idles: start afresh
            self.close()
        return out

    def close(self, force: bool = False) -> None:
        _POOLS.pop(self.world_size, None)
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        self._dir.cleanup()


def _context() -> Any:
    """Workers forked from the fork server (``PRELOAD`` imported there once; it shares none of the test
    process's state), or spawned where a platform has no fork server, and on a machine with a CUDA device:
    CUDA cannot run in a process forked from one that initialised it, and whether importing megatron-core
    does so has not been checked on a GPU (the GPU tests run cases in pools)."""
    if "forkserver" not in mp.get_all_start_methods() or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on every rank of a gloo world; return per-rank results.

    A case that fails only because gloo could not connect a group (``TransportFailure``) runs once more on
    a fresh pool; any other failure is reported at once."""
    try:
        return _pool(world_size).run(fn, args, timeout)
    except TransportFailure:  # the failed pool is closed: this runs on a fresh one
        return _pool(world_size).run(fn, args, timeout)


def _pool(world_size: int) -> _Pool:
    if world_size not in _POOLS:
        _POOLS[world_size] = _Pool(world_size)
    return _POOLS[world_size]


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
