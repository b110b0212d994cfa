# Quick start: `make demo` runs the main job on the host backend; `make test` runs every CPU test.
BUILD ?= build
CMAKE_FLAGS ?=
JOBS ?= $(shell nproc)

.PHONY: all deps configure build test demo bench clean install test-sanitize test-tsan fuzz-smoke

all: build

deps:
	@./scripts/setup-deps.sh

configure: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE gpu

demo: build
	@./scripts/demo.sh $(BUILD)

# A long verified run that watches the daemon's RSS and fds: 8 clients x 100000 ops, minutes;
# not part of `make test`. SOAK_ARGS="--ops 2000" shortens it (epd-soak --help).
# The bystander's dispatch p50/p99 under each attack of a hostile tenant beside its quiet
# figures, and the PEER_LOST latency over 1100 kills (epd-soak-hostile --help); about a minute.
.PHONY: soak-hostile
SOAK_HOSTILE_ARGS ?=
soak-hostile: build
	./$(BUILD)/bin/epd-soak-hostile $(SOAK_HOSTILE_ARGS)

.PHONY: soak
SOAK_ARGS ?=
soak: build
	./$(BUILD)/bin/epd-soak $(SOAK_ARGS)

test-sanitize: deps
	@cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DEPD_SANITIZE=ON -DEPD_CUDA=OFF >/dev/null
	@cmake --build build-asan -j $(JOBS)
	cd build-asan && CK_TIMEOUT_MULTIPLIER=4 ctest --output-on-failure -j $(JOBS) -LE gpu

# ThreadSanitizer (clang) over the same suite, less three tests: the Python one (the interpreter
# is not instrumented), and unit_exec and integ_faults, whose large workloads and
# calibrated kill timing do not survive TSan's 10-20x slowdown (integ_ops, integ_doorbell and
# integ_resize drive the same threads). Check's per-test timeouts, there to catch hangs, are
# scaled by CK_TIMEOUT_MULTIPLIER for the same slowdown (both sanitizer suites). setarch -R:
# clang 14's TSan cannot map its shadow under the larger address randomisation of newer
# kernels. Any race report fails its test.
test-tsan: deps
	@./scripts/setup-fuzz-deps.sh
	@cmake -S . -B build-tsan -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug -DEPD_TSAN=ON \
		-DEPD_CUDA=OFF >/dev/null
	@cmake --build build-tsan -j $(JOBS)
	cd build-tsan && TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" CK_TIMEOUT_MULTIPLIER=4 \
		setarch $$(uname -m) -R ctest --output-on-failure -j $(JOBS) -LE 'gpu|python' \
		-E '^(unit_exec|integ_faults)$$'

# libFuzzer targets (tests/fuzz): clang + ASan/UBSan in build-fuzz, seeds and past crashes
# replayed, then each target fuzzed for FUZZ_SECONDS; fails on any crash.
FUZZ_SECONDS ?= 60
fuzz-smoke: deps
	@./scripts/setup-fuzz-deps.sh
	@./scripts/fuzz-smoke.sh build-fuzz $(FUZZ_SECONDS)

install: build
	cmake --install $(BUILD) --prefix $(or $(PREFIX),/usr/local)

clean:
	rm -rf $(BUILD) build-asan build-tsan build-fuzz
