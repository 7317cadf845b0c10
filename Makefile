# One-command entry points. Each target sets the environment up from scratch when needed
# (a virtualenv in .venv, torch 2.13.0 first, then the package with the same torch pin),
# so `make test` and `make train` work on a fresh clone. --no-compile: pip byte-compiled every module of
# every package (most of torch is never imported here), over half the set-up's time; Python compiles what
# is imported at its first import instead.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-gpu train clean

$(STAMP): setup.py constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -c constraints.txt -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

# Two pytest-xdist workers: one process leaves a core of the 2-core machine idle a third of the time.
# --dist loadscope: a module's tests run in one worker, so its fixtures (a trained run, converted checkpoints)
# and warm caches serve all of them: pytest 848 s against 948 s spread test by test, 1505 against 1587
# CPU-seconds (1687 with only the tests that share a fixture kept together: --dist loadgroup).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope tests

# On a CUDA machine, in your own environment (no venv, your CUDA torch): the kernel report, the GPU
# tests, member-schedule cases, the benchmark at 32K and 128K and a 30-step bf16 pretrain, each under
# its own timeout, results in $(GPU_RESULTS). make test-gpu PYTHON=/path/to/the/python/with/cuda/torch
PYTHON ?= python3
GPU_RESULTS ?= runs/gpu_checks
SUITE ?= 1
test-gpu:
	PYTHON=$(PYTHON) SUITE=$(SUITE) bash tools/gpu_checks.sh $(GPU_RESULTS)

# The main job: a tiny Llama-style GPT on the bundled Shakespeare corpus, 4 CPU processes, CP=4 as a
# hierarchy [2, 2] (all-to-all pairs, a ring of 2). A second run resumes from $(RUN). A longer run is a
# new run: make train STEPS=600 RUN=runs/tiny_cpu_600. The checks that need no process group run first,
# in one process, so a refused run (e.g. a changed STEPS on a finished run) prints one error, no traceback.
STEPS ?= 300
RUN ?= runs/tiny_cpu
TRAIN_ARGS = --recipe recipes/tiny_cpu.yaml --run-dir $(RUN) model.context_parallel_size=4 \
	'model.hierarchical_context_parallel_sizes=[2,2]' model.cp_comm_type=a2a+p2p train.steps=$(STEPS)
train: $(STAMP)
	$(BIN)/python -m mcp_context.pretrain --check-launch 4 $(TRAIN_ARGS)
	$(BIN)/torchrun --nproc-per-node 4 -m mcp_context.pretrain $(TRAIN_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
