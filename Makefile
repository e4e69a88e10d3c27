# yatt-hpc — the two commands a newcomer runs first:
#   make demo    install, then the GRPO demo on the embedded CPU default (runs/demo)
#   make test    install, start the dev Slurm cluster (root + apt), run every test layer, stop it again
VENV      ?= .venv
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip --disable-pip-version-check
STAMP     := $(VENV)/.installed
RUN_DIR   ?= runs/demo
PYTEST_ARGS ?=
LOCK      := constraints/lock.txt
# where `make lock` finds the CPU build of torch: this machine's wheel directory; elsewhere e.g.
#   make lock TORCH_SOURCE="--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match"
TORCH_SOURCE ?= --find-links /opt/wheels

.PHONY: install lock demo test test-faults test-unit system-deps cluster-start cluster-stop bench lint clean

install: $(STAMP)

# Re-runs only when setup.py or the pins change. Every version comes from $(LOCK); torch comes first
# and pinned to the CPU build that lies on this machine's disk, so nothing later can resolve a
# multi-GB CUDA build.
$(STAMP): setup.py constraints/cpu.txt $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -c constraints/cpu.txt -c $(LOCK) torch==2.13.0
	$(PIP) install -q -c constraints/cpu.txt -c $(LOCK) -e '.[dev]'
	touch $@

# The one command that refreshes the pins: the project's [dev] install and B9's peer (TRL), resolved
# together so both venvs get one transformers. Then `make install`, `make test`, and commit the lock.
lock: install
	$(VENV)/bin/uv pip compile setup.py bench/peers/requirements.txt constraints/cpu.txt --extra dev \
	    --python-version 3.11 $(TORCH_SOURCE) --custom-compile-command 'make lock' -o $(LOCK)

# Open MPI (+ PMIx) from Debian for mpirun; a no-op when already there.
system-deps:
	@command -v mpirun >/dev/null || bash tools/system-deps.sh

demo: install system-deps
	$(VENV)/bin/yatt-hpc run configs/demo_cpu.yaml --run-dir $(RUN_DIR)

test: install
	bash tools/run-tests.sh $(PYTEST_ARGS)

test-faults: install
	YATT_FULL_FAULT_MATRIX=1 $(PY) -m pytest tests/mpi/test_faults.py tests/mpi/test_engine_signals.py tests/mpi/test_exact_resume.py tests/mpi/test_stop_grace.py tests/mpi/test_recipes_run.py tests/mpi/test_sharded_optimizer.py tests/mpi/test_pipeline.py tests/mpi/test_async_run.py tests/mpi/test_agent_run.py tests/mpi/test_tool_calls.py tests/mpi/test_code_reward_run.py tests/mpi/test_trackers_run.py tests/mpi/test_critic_layouts.py tests/mpi/test_critic_run.py tests/mpi/test_moe.py tests/mpi/test_moe_run.py tests/mpi/test_demo_moe_run.py tests/slurm -q $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest tests/unit tests/golden -q $(PYTEST_ARGS)

cluster-start:
	bash tools/slurm-dev-cluster.sh start

cluster-stop:
	bash tools/slurm-dev-cluster.sh stop

bench: install system-deps
	$(PY) bench/run_all.py

lint: install
	$(VENV)/bin/ruff check yatt_hpc tests tools bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
