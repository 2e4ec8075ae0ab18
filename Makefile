# One command for the main job, one for the tests; each installs what it needs into .venv here.
# llama-cpp-python ships only an sdist: the first install compiles llama.cpp (a few minutes on two
# cores); pip's wheel cache makes later installs fast.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed-stamp
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF

.PHONY: run test install clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/s2moe $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
