# One-command set-up: `make test` and `make report` build .venv when it is missing or stale.
SHELL := /bin/bash
# This Makefile's folder (the checkout), also when make runs elsewhere with -f.
MAKEFILE_DIR := $(dir $(abspath $(lastword $(MAKEFILE_LIST))))
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MXVENV ?= .venv-mxnet
MXSTAMP := $(MXVENV)/.installed
CORES ?= $(shell nproc)
PYTEST_ARGS ?=
# Test workers (pytest-xdist) for make test and make check: three on the 2-core CI machine, whose suite
# waits a third of its time (schedulers, job start-ups, provoked timeouts): measured 1,012 s of pytest
# on 3 against 1,142 s on 2; 4 workers were slower again, 857 s against 809 s on 3 (bench/RESULTS.md,
# 2026-12-03). tests/conftest.py keeps each module on one worker and orders the modules longest first;
# --no-loadscope-reorder keeps that order (xdist would hand out the modules with the most tests first).
TEST_WORKERS ?= 3
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
# make run: your config file(s), the target, and extra Snakemake options (e.g. SNAKEMAKE_ARGS=-n).
CONFIG ?=
TARGET ?= results/report.html
SNAKEMAKE_ARGS ?=
# Jobs started by Snakemake find this interpreter first.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: test check report run stop dryrun lint style format env mxnet-env clean gpu-check

env: $(STAMP)

$(STAMP): envs/requirements.txt envs/requirements-common.txt pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -r envs/requirements.txt
	$(PY) -m pip install -q -e . --no-deps
	@touch $@

# mxnet 1.9.1 imports only with numpy 1.23.x: it lives in its own small env (format authority).
mxnet-env: $(MXSTAMP)

$(MXSTAMP): envs/mxnet-interop.txt
	@test -x $(MXVENV)/bin/python || python3 -m venv $(MXVENV)
	$(MXVENV)/bin/python -m pip install -q -r envs/mxnet-interop.txt
	@touch $@

# Style first: it takes seconds, so a formatting slip fails at once instead of after the suite.
test: $(STAMP) $(MXSTAMP) style
	@# pytest exit code 5 means no test ran: that is a failure here, not a pass. --durations: the slowest
	@# tests in every CI log, to keep the suite well under 20 minutes.
	$(PY) -m pytest tests $(PYTEST_PARALLEL) --durations=25 $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc
	$(VENV)/bin/snakemake -n results/report.html
	$(VENV)/bin/snakemake --lint

# The edit loop's fast tier: style, then every test not marked slow (none runs a pipeline or a training
# job). make test stays the complete suite that CI runs.
check: $(STAMP) $(MXSTAMP) style
	$(PY) -m pytest tests $(PYTEST_PARALLEL) -m "not slow" -q $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The last line names the report, also when it was up to date (Snakemake names it only when it wrote it:
# RECTRAIN_REPORT_LINE=0 keeps it from saying it twice); a dry-run (SNAKEMAKE_ARGS=-n) names none.
DRY_RUN := $(filter -n --dry-run --dryrun -np -pn,$(SNAKEMAKE_ARGS))
report: $(STAMP)
	RECTRAIN_REPORT_LINE=0 $(VENV)/bin/snakemake --cores $(CORES) $(SNAKEMAKE_ARGS) results/report.html
	@test -n "$(DRY_RUN)" || test ! -f results/report.html || echo "report: $(abspath results/report.html)"

# Your own config without Snakemake's argument rules (--configfile takes every word after it, so the
# target goes before it): make run CONFIG=config/my-data.yaml [TARGET=...] [SNAKEMAKE_ARGS=-n].
run: $(STAMP)
	@test -n "$(CONFIG)" || { echo "make run: say which config, e.g. make run CONFIG=config/my-data.yaml" >&2; exit 2; }
	@for f in $(CONFIG); do test -f "$$f" || { echo "make run: config file $$f not found" >&2; exit 2; }; done
	RECTRAIN_REPORT_LINE=0 $(VENV)/bin/snakemake --cores $(CORES) $(SNAKEMAKE_ARGS) $(TARGET) --configfile $(CONFIG)
	@test -n "$(DRY_RUN)" || for f in $(filter %report.html,$(TARGET)); do test ! -f "$$f" || echo "report: $(CURDIR)/$$f"; done

# From another shell: stop the runs going in this folder (RUN=<pid>: that one alone) as SIGTERM to their
# Snakemake process does - training writes its checkpoint, every job ends, and the run exits with status
# 75 (docs/watching.md). Each run registered itself in a folder of yours alone, and only a process that is
# still the one registered (pid, start time, user) is signalled (rectrain.snakefile.runs).
RUN ?=
stop:
	@PYTHONSAFEPATH=1 PYTHONPATH=$(MAKEFILE_DIR)workflow $(if $(wildcard $(PY)),$(PY),python3) -m rectrain.snakefile.runs stop $(RUN)

# The report of a run still training, stopped or killed: results/<dataset>/<run>/live.html (each run of a sweep), built again at each
# call (docs/watching.md). CONFIG as for make run; empty: the demo. Snakemake's lock does not stop it.
.PHONY: live
live: $(STAMP)
	$(PY) -m rectrain.report.live $(if $(CONFIG),--configfile $(CONFIG))

dryrun: $(STAMP)
	$(VENV)/bin/snakemake -n results/report.html

lint: $(STAMP)
	$(VENV)/bin/snakemake --lint

# What `make format` would change: Python (ruff, pyproject.toml [tool.ruff]) and the rules (snakefmt).
style: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/snakefmt --check Snakefile workflow/rules

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/snakefmt Snakefile workflow/rules

# On a GPU machine: pipeline with config/gpu.yaml + efficiency bench + 11 GB check (bench/GPU_RUNBOOK.md).
gpu-check:
	bash bench/gpu_check.sh $(GPU_CHECK_OUT)

clean:
	rm -rf results/demo results/gpudemo results/fast_storage logs benchmarks .snakemake results/report.html
