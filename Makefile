# rgpu: `make run` trains a small model on a local rgpu-opserver; `make test` runs every test.
# Both set everything up on a fresh Debian machine first (packages, .venv with torch, build).

PYTHON_SYS ?= python3
VENV       := .venv
PY         := $(VENV)/bin/python
BUILD      := build
FUZZ_BUILD := build-fuzz
FUZZ_TARGETS := frame_fuzz graph_fuzz session_fuzz planes_fuzz seal_fuzz store_fuzz
FUZZ_SECONDS ?= 60
TORCH_PIN  ?= torch==2.13.0
DEB_PKGS   := capnproto libcapnp-dev libuv1-dev llvm-dev libgtest-dev libbenchmark-dev ninja-build ccache \
              clang-14 libclang-rt-14-dev libsodium-dev libgloo-dev zlib1g-dev
SUDO       := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
CCACHE     := $(shell command -v ccache 2>/dev/null)

.PHONY: all deps venv build test test-cpp test-python test-package test-fuzz fuzz fuzz-build run bench clean

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

# The training frameworks test_frameworks.py drives, the notebook kernel test_interrupt.py
# drives and pytest's parallel runner (a venv made before them gets them too).
$(VENV)/.test-packages: | $(VENV)/.stamp
	$(PY) -m pip install -q "$(TORCH_PIN)" accelerate==1.16.0 lightning==2.6.6 ipykernel==7.4.0 \
	  jupyter_client==8.10.0 pytest-xdist==3.8.0
	touch $@

venv: $(VENV)/.stamp $(VENV)/.test-packages

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

# Two test processes: most tests wait on servers and subprocesses (12 min in two; a third
# process does not help on two cores, where the compiles and transfers then compete). Work
# stealing: a process that ran out of tests takes the other's, so neither ends alone with a
# long one.
test-python: build
	$(PY) -m pytest -q -n 2 --dist worksteal test/python

# rgpu as pip installs it: `pip install .` and `pip wheel .` of a clean clone of this commit,
# each into a fresh venv with only torch, then a training step from each (test/package).
test-package: deps
	PYTHON_SYS=$(PYTHON_SYS) TORCH_PIN="$(TORCH_PIN)" test/package/check.sh

# The fuzz targets: a separate clang build with libFuzzer, ASan and UBSan (test/fuzz).
$(FUZZ_BUILD)/build.ninja: CMakeLists.txt | $(VENV)/.stamp
	CC=clang-14 CXX=clang++-14 $(VENV)/bin/cmake -S . -B $(FUZZ_BUILD) -G Ninja \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRGPU_FUZZ=ON \
	  -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
	  -DPython3_EXECUTABLE="$$(realpath $(PY))" \
	  $(if $(CCACHE),-DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE))

fuzz-build: deps venv $(FUZZ_BUILD)/build.ninja
	+$(VENV)/bin/cmake --build $(FUZZ_BUILD)

# `make fuzz FUZZ_SECONDS=1800`: every target for that long, one after another.
fuzz: fuzz-build
	for t in $(FUZZ_TARGETS); do test/fuzz/run.sh $(FUZZ_BUILD) $$t $(FUZZ_SECONDS) || exit 1; done

# The smoke run of `make test`: every seed and regression input, then a few seconds of fuzzing.
test-fuzz: fuzz-build
	for t in $(FUZZ_TARGETS); do test/fuzz/run.sh $(FUZZ_BUILD) $$t 10 -runs=20000 || exit 1; done

# The Python tests first, with the machine to themselves; then the C++ tests (which mostly
# wait on a server's timeouts), the packaging check and the fuzz smoke run side by side.
test: test-python
	@$(MAKE) --no-print-directory -j3 --output-sync=target test-cpp test-package test-fuzz

run: build
	$(PY) examples/train.py

# `make bench QUICK=1`: the reduced suite (fewer steps, rounds and relays). Results in bench/results/.
bench: build
	$(PY) -m pip install -q matplotlib
	$(PY) bench/suite.py --build $(BUILD) $(if $(QUICK),--quick)

clean:
	rm -rf $(BUILD) $(FUZZ_BUILD) python/rgpu/_C*.so python/rgpu/bin
