"""The suite runs in two pytest-xdist workers (``make test``: ``-n 2``): in one process it left a core of the
2-core machine idle about a third of the time, waiting on the processes it launched. A module's tests run in
one worker (``--dist loadscope``), so a module fixture is made once.

Under xdist, each worker

- runs torch on one thread, as do the processes it starts (``OMP_NUM_THREADS``): two workers already fill
  the cores, and a second thread each only contends;
- has its own rendezvous port for the torchrun launches it makes (torchrun reads ``PET_MASTER_PORT`` as
  ``--master-port``; both workers would take 29500 and one would fail to bind); the README's commands, run
  in a bare shell, get the same variable (``tests/test_docs_commands.py``).
"""
from __future__ import annotations

import os

TORCHRUN_PORT_ENV = "PET_MASTER_PORT"
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ... under xdist; unset in one process
if _worker.startswith("gw"):
    os.environ.setdefault(TORCHRUN_PORT_ENV, str(29500 + 10 * (1 + int(_worker[2:]))))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
