# voicelane: the two commands that matter are `make serve` and `make test`. Both set everything up first.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip install --disable-pip-version-check -q
TORCH   ?= torch==2.13.0
# PyPI's Linux torch wheel brings several GB of CUDA libraries. On a laptop or any machine without an NVIDIA GPU:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
ARGS    ?=

.PHONY: setup system-deps test-deps serve test lint clean

# System libraries: libopus for Opus audio. Installed with apt when missing and we are root (CI, containers).
system-deps:
	@if ! ldconfig -p 2>/dev/null | grep -q libopus.so.0; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopus0 >/dev/null; \
		else echo "libopus is missing: run 'sudo apt-get install libopus0' (Opus output needs it)"; fi; fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "installing $(TORCH)$(if $(TORCH_INDEX), from $(TORCH_INDEX), from PyPI: with CUDA libraries (several GB; CPU only: make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu))"
	$(PY) -m pip install --disable-pip-version-check --progress-bar on $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) -e '.[server]'
	# The real Qwen BPE ranks (qwen.tiktoken) ship in the dashscope wheel; only that file is read.
	$(PIP) --no-deps dashscope==2.0.2
	touch $@

setup: system-deps $(VENV)/.installed

$(VENV)/.test-installed: $(VENV)/.installed
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	   { ! command -v opusinfo >/dev/null || ! command -v chromium >/dev/null; }; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq opus-tools chromium >/dev/null; fi
	# playwright drives Debian's /usr/bin/chromium: never run `playwright install` (it downloads a browser).
	$(PIP) -e '.[server,bench,test]' openai==3.57.0 playwright==1.65.2 httpx==0.28.1 matplotlib==3.11.2
	# Triton kernels are checked on the CPU in its interpreter (TRITON_INTERPRET=1), the GPU image's version.
	$(PIP) triton==3.6.0 hypothesis==6.170.17
	# The official package is the parity oracle; its heavy audio deps are stubbed by tests/qwen_oracle.py.
	$(PIP) transformers==4.57.3 einops==0.8.2 tiktoken==0.14.0
	$(PIP) --no-deps qwen-tts==0.1.1
	touch $@

test-deps: setup $(VENV)/.test-installed

serve: setup
	$(PY) -m server serve $(ARGS)

lint: test-deps
	$(PY) -m ruff check .

test: test-deps lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
