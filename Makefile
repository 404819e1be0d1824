# `make test` and `make demo` work on a fresh machine: they create .venv and install first.
# Both are CPU jobs: with jax[tpu] installed (the AOT check), JAX must not try to start libtpu.
export JAX_PLATFORMS ?= cpu
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-test

.PHONY: test demo install clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# The main job on the embedded CPU default (configs/demo_cpu.py): a tiny random policy, so the
# curves are flat until the warm-started demo lands; a fresh run each time.
demo: $(STAMP)
	rm -rf runs/demo
	$(PY) -m sem_jax.train --config.run_dir=runs/demo

clean:
	rm -rf $(VENV) build *.egg-info
