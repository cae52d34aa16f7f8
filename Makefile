# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv on first use (CPU build of torch 2.13 + pinned test deps).
VENV := .venv
PYTHON := $(VENV)/bin/python

.PHONY: demo test setup
setup: $(VENV)/installed

$(VENV)/installed: pyproject.toml requirements-ci.txt requirements-ci-nodeps.txt
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -r requirements-ci.txt
	$(PYTHON) -m pip install -q --no-deps -r requirements-ci-nodeps.txt
	$(PYTHON) -m pip install -q --no-deps -e .
	touch $@

demo: setup
	$(PYTHON) examples/qwen3_moe.py

test: setup
	$(PYTHON) -m pytest -q -n 2
