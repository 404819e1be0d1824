# `make test` and `make demo` work on a fresh machine: they create .venv and install first.
# Both are CPU jobs: with jax[tpu] installed (the AOT check), JAX must not try to start libtpu.
export JAX_PLATFORMS ?= cpu
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test demo demo-baseline install clean

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

test: $(VENV)/.installed-test
	$(PY) -m pytest -q tests

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
