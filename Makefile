# rgpu: `make run` trains a small model on a local rgpu-opserver; `make test` runs every test.
# Both set everything up on a fresh Debian machine first (packages, .venv with torch, build).

PYTHON_SYS ?= python3
VENV       := .venv
PY         := $(VENV)/bin/python
BUILD      := build
TORCH_PIN  ?= torch==2.13.0
DEB_PKGS   := capnproto libcapnp-dev libuv1-dev llvm-dev libgtest-dev libbenchmark-dev ninja-build ccache
SUDO       := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
CCACHE     := $(shell command -v ccache 2>/dev/null)

.PHONY: all deps venv build test test-cpp test-python run bench clean

all: build

deps:
	@missing=$$(for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:" $$missing; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $$missing; \
	fi

$(VENV)/.stamp:
	$(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" numpy pytest expecttest cmake ninja setuptools safetensors transformers==5.24.0
	touch $@

venv: $(VENV)/.stamp

$(BUILD)/build.ninja: CMakeLists.txt | $(VENV)/.stamp
	$(VENV)/bin/cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
	  -DPython3_EXECUTABLE="$$(realpath $(PY))" \
	  $(if $(CCACHE),-DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE))

build: deps venv $(BUILD)/build.ninja
	$(VENV)/bin/cmake --build $(BUILD)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

test-cpp: build
	cd $(BUILD) && ../$(VENV)/bin/ctest --output-on-failure

test-python: build
	$(PY) -m pytest -q test/python

test: test-cpp test-python

run: build
	$(PY) examples/train.py

# `make bench QUICK=1`: the reduced suite (a few minutes). Results in bench/results/.
bench: build
	$(PY) -m pip install -q matplotlib
	$(PY) bench/suite.py --build $(BUILD) $(if $(QUICK),--quick)

clean:
	rm -rf $(BUILD) python/rgpu/_C*.so python/rgpu/bin
