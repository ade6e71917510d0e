# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv and install everything they need on a fresh machine.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel on this machine kind; on a GPU machine set TORCH_SPEC="torch" (any recent CUDA build).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, and named again below, so that no dependency swaps in a CUDA build.
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]" "$(TORCH_SPEC)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/runtime_demo.py

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
