# One command for the main job, one for the tests; each installs what it needs into .venv here.
# llama-cpp-python ships only an sdist: the first install compiles llama.cpp (a few minutes on two
# cores); pip's wheel cache makes later installs fast.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed-stamp
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF

.PHONY: run test check typecheck install clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/s2moe $(ARGS)

test: $(STAMP) check
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# Lint, format and types: strict on the engine.
check: $(STAMP) typecheck
	$(VENV)/bin/ruff check --quiet .
	$(VENV)/bin/ruff format --check --quiet .

# .typecheck/s2moe/__init__.py makes s2moe a regular package to mypy: under a namespace package mypy takes
# the folder engine/zoo/data/ (package data) for the module engine/zoo/data.py.
typecheck: $(STAMP)
	mkdir -p .typecheck/s2moe
	for d in engine app native profiles; do ln -sfn ../../$$d .typecheck/s2moe/$$d; done
	touch .typecheck/s2moe/__init__.py
	cd .typecheck && ../$(VENV)/bin/mypy --config-file ../pyproject.toml -p s2moe.engine

clean-venv:
	rm -rf $(VENV)
