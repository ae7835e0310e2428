# privkit: make run | make test | make test-slow | make docs | make bench | make soak | make lock
# Each target creates .venv if missing and installs the project first. Everything is installed
# with -c constraints.txt: the versions CI passed with (make lock refreshes them deliberately).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q -c constraints.txt
STAMP  := $(VENV)/.privkit-installed
FULL   := $(VENV)/.privkit-installed-full
BENCH  := $(VENV)/.privkit-installed-bench

.PHONY: run test test-slow docs bench lint clean soak lock

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 first when no torch is present: a looser requirement could pull
# a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PIP) -e ".[dev,examples]"
	touch $(STAMP)

# make test also needs the Flower adapters' and the docs site's dependencies.
$(FULL): $(STAMP)
	$(PIP) -e ".[dev,examples,flower,docs]"
	touch $(FULL)

# make bench also needs Opacus (the record-level comparison of bench/private_utility.py).
$(BENCH): $(FULL)
	$(PIP) -e ".[dev,examples,flower,docs,bench]"
	touch $(BENCH)

run: $(STAMP)
	$(VENV)/bin/privkit demo

# The library is type-checked (mypy privkit) and the docs are built strictly (a broken link or
# docstring fails the build); tests/test_readme.py runs every example in README.md and docs/ and
# checks the output shown under it.
test: $(FULL)
	$(PY) -m pytest -q -n auto --dist loadfile -m "not slow"
	$(VENV)/bin/ruff check privkit fl_examples tests bench
	$(VENV)/bin/mypy privkit
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d $$(mktemp -d)/site

# The long simulations, sweeps and kill-point tests (tests/conftest.py lists them); CI runs it
# after make test.
test-slow: $(FULL)
	$(PY) -m pytest -q -n auto --dist loadfile -m slow

docs: $(FULL)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The reliability suite's full sweep (10^4 accountant settings, 24 kill points, audit rates).
soak: $(FULL)
	PRIVKIT_SOAK=1 $(PY) -m pytest -q -s tests/reliability

bench: $(BENCH)
	$(PY) bench/accounting.py
	$(PY) bench/imports.py
	$(PY) bench/private_round.py
	$(PY) bench/mechanisms.py
	$(PY) bench/secure.py
	$(PY) bench/trainers.py
	$(PY) bench/mapa.py --quick
	$(PY) bench/scfl.py
	$(PY) bench/rec.py --quick
	$(PY) bench/flower.py
	$(PY) bench/private_utility.py --quick --out runs/private_utility-quick

lint: $(STAMP)
	$(VENV)/bin/ruff check privkit fl_examples tests bench
	$(VENV)/bin/mypy privkit

# Refresh constraints.txt from the ranges in pyproject.toml: a fresh venv, the newest versions
# the ranges admit, then pip freeze. Run make test on the result before committing it.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q torch==2.13.0
	.venv-lock/bin/python -m pip install -q -e ".[dev,examples,flower,docs,bench]"
	{ sed -n '/^#/p' constraints.txt; .venv-lock/bin/python -m pip freeze --exclude-editable \
	  | sed 's/+cpu$$//'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf .venv-lock

clean:
	rm -rf $(VENV) build *.egg-info
