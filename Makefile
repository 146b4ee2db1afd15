# `make lab` and `make test` bootstrap .venv on first use, then reuse it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.megacpp-lab-installed
# Tests and notebooks share one inductor cache, so each compiled block is built once per run.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/build/inductor-cache
export PYTHONUNBUFFERED := 1
# `make lab` listens on LAB_IP:LAB_PORT: loopback by default, so a remote box is reached through an ssh
# tunnel (scripts/lab.py prints the command). LAB_ARGS passes further flags to `jupyter lab`.
LAB_IP ?= 127.0.0.1
LAB_PORT ?= 8888
LAB_ARGS ?=
# pytest workers (pytest-xdist), one file (a test file, or a notebook with its cells in order) each at a time, each
# worker with one OpenMP thread. A notebook's kernel keeps one core busy: serially, at 3f4a787 on a 2-core machine, the
# notebooks took 895 s; over two workers of one thread, 464 s (that run found the serial run's graphs in inductor's
# cache, which CI's notebooks do not). An earlier measurement with two threads a worker: 792 s against 459 serial.
TEST_WORKERS ?= 2

.PHONY: install libibverbs lab test tour data clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Pinned by itself first: here the pin resolves to the CPU build on local disk, on a CUDA host to the CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	@$(MAKE) --no-print-directory libibverbs
	$(BIN)/python -m pip install -q -e '.[lab,test,mooncake,tripwires]'
	@touch $(STAMP)

# The Mooncake wheel (the `mooncake` extra) links against libibverbs.so.1, even for TCP. Installed with apt-get
# when it is missing and we are root; otherwise a message, and the Mooncake tests skip naming libibverbs1.
libibverbs:
	@if { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q 'libibverbs\.so\.1 '; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing libibverbs1 (needed by the Mooncake backend)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null) || \
		echo "warning: apt-get could not install libibverbs1; the Mooncake tests will skip"; \
	else \
		echo "note: libibverbs1 is missing and cannot be installed here (needs apt-get and root);" \
			"the Mooncake backend and its tests are skipped. Install it with: sudo apt-get install -y libibverbs1"; \
	fi

# One script for users and CI: tests/test_lab_server.py runs this very target and queries the server.
lab: $(STAMP)
	$(BIN)/python scripts/lab.py --ip '$(LAB_IP)' --port '$(LAB_PORT)' -- $(LAB_ARGS)

# The regression packs' sentinels first, on the console (exit 1 on a deviation, naming the pack); then two runs so
# the log shows the unit-test and the notebook (nbval) counts apart, each with its 15 slowest tests or cells. The
# unit tests' files and the notebooks start heaviest first (tests/conftest.py, notebooks/conftest.py), so that the two
# workers end together; --no-loadscope-reorder keeps that order (pytest-xdist >= 3.5 otherwise deals loadfile's files
# by their count of tests, most first, and the conftests' order broke only ties).
# One intra-op thread a worker: two workers of torch's default two threads put four spinning OpenMP threads on CI's
# two cores. The unit tests at one commit on a 2-core machine: 16.6 min with one thread a worker, 23.8 min without (a
# fresh clone; one run each, and such a machine's speed varies from run to run).
test: $(STAMP)
	$(BIN)/megacpp-lab tripwires
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest --nbval-lax notebooks -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

tour: $(STAMP)
	$(BIN)/megacpp-lab tour --notebooks notebooks --out build

# the corpus (a download, reused from its cache), then the tokenizer and the samples from its training split
data: $(STAMP)
	$(BIN)/megacpp-lab data corpus
	$(BIN)/megacpp-lab data --root "$${MEGACPP_CORPUS_DIR:-$$HOME/.cache/megacpp-lab/corpus}" --train-tokenizer

clean:
	rm -rf build .pytest_cache
