# privkit: make run | make test | make bench
# Each target creates .venv if missing and installs the project first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.privkit-installed

.PHONY: run test bench lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 first when no torch is present: a looser requirement could pull
# a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,examples]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/privkit demo

test: $(STAMP)
	$(PY) -m pytest -q
	$(VENV)/bin/ruff check privkit fl_examples tests bench

bench: $(STAMP)
	$(PY) bench/accounting.py

lint: $(STAMP)
	$(VENV)/bin/ruff check privkit fl_examples tests bench
	$(VENV)/bin/mypy privkit

clean:
	rm -rf $(VENV) build *.egg-info
