PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,examples,gpu,tpu]'
	touch $(STAMP)

# No JAX_PLATFORMS: the demo trains on a GPU or TPU where there is one; where there is
# none, importing hlo_amp starts jax on CPU, quietly (hlo_amp/quiet_stderr.py).
demo: $(STAMP)
	$(BIN)/python examples/vit_digits.py

# JAX_PLATFORMS=cpu on every machine: the tests expect CPU runs, and with CPU asked for the
# gpu extra's CUDA plugin registers (for compiling for a GPU without one) without its CUDA
# version check; the tpu extra's libtpu compiles for a TPU topology without one the same way.
# XLA_FLAGS: XLA:CPU's LLVM at -O1, not -O3. Compiling is most of the tests' time; at -O1
# it takes a fifth to a third less CPU (test_third_party: 86 -> 69 s), the demo ViT steps
# as fast and to the same accuracy, and deviceless GPU/TPU compiles give the same
# optimized HLO and memory figures (the flag reaches only LLVM code generation).
TEST_ENV := PATH="$(CURDIR)/$(BIN):$$PATH" JAX_PLATFORMS=cpu \
	XLA_FLAGS="--xla_backend_optimization_level=1 $$XLA_FLAGS"

test: $(STAMP)
	$(TEST_ENV) $(BIN)/lit -v tests/lit
	$(TEST_ENV) $(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder tests/py

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

lint: $(STAMP)
	$(BIN)/ruff check hlo_amp tests benchmarks examples

clean:
	rm -rf $(VENV) out .pytest_cache
