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
# XLA_FLAGS: compiling for CPU is most of the tests' time; two flags halve it. Deviceless
# GPU/TPU compiles give the same optimized HLO and memory figures with them (they act after
# XLA's HLO passes; -O0 also shortens XLA:GPU's LLVM step).
# * XLA:CPU's LLVM at -O0, not -O3: pytest 601 -> 537 s on a 2-core Xeon.
# * XLA:CPU's older elemental emitters for fusions, not its MLIR fusion emitters, whose
#   pipeline takes most of a small program's compile: 537 -> 373 s (a train step's compile
#   1.5 -> 0.5 s). Results differ at most in rounding: every test passes with both, and
#   of the demo's 300-step trainings only fp8's ends elsewhere (81.9% against 84.2%).
# * XLA:CPU's LLVM module in one piece, not split into parts (--xla_cpu_parallel_codegen_
#   split_count) for compiling on several threads: each part builds its own LLVM target
#   machine and links XLA's intrinsics, which with one CPU per pytest worker is all cost (a
#   small value_and_grad step: 130-160 -> 82-87 ms a compile). Results differ at most in
#   f32's last bits at -O0 (gpu_workloads' steps: 1e-6 at most), not at all at -O1.
# * Deviceless GPU compiles: ptxas at -O0 and LLVM without its expensive passes, for
#   kernels nothing runs (they act after XLA's HLO passes and buffer assignment, which
#   the tests read): test_partition_plan + test_gpu_target 131 -> 117 s of CPU.
# The demo trainings run in a child process without these flags, at -O1
# (tests/py/test_demo_mixed.py): their 1,200 steps run slower at -O0.
# A flag the installed jaxlib does not know would abort every test process: tests/xla_flags.py
# keeps the ones it knows (jax 0.11.2 has no --xla_cpu_use_fusion_emitters).
TEST_XLA_FLAGS := --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false \
	--xla_gpu_disable_gpuasm_optimizations=true --xla_llvm_disable_expensive_passes=true \
	--xla_cpu_parallel_codegen_split_count=1
TEST_ENV := PATH="$(CURDIR)/$(BIN):$$PATH" JAX_PLATFORMS=cpu

# pytest's workers and the tests' child processes share one JAX persistent compilation
# cache, new and empty each run (nothing carries over between runs): a program one of
# them compiled for CPU is read back, not compiled again, by the others (a tenth or more
# of the suite's CPU). Programs compiled for a GPU or TPU without one cannot be read back
# (jax warns that it could not, and compiles them); XLA:GPU's kernel cache, a file in a
# second new directory, does that for their kernels: a kernel (a fused computation on
# given shapes) that an earlier compile of the run made is read back, not run through
# LLVM and ptxas again (on a 2-core Xeon: test_gpu_target 78 -> 65 s). The optimized HLO
# and memory figures the tests read are XLA's before it makes kernels, so they are the
# same; benchmarks/compile_cost.py drops the flag, as it counts the kernels compiled.
test: $(STAMP)
	cache=$$(mktemp -d); kernels=$$(mktemp -d); \
	flags="$$($(BIN)/python tests/xla_flags.py $(TEST_XLA_FLAGS) \
	  --xla_gpu_kernel_cache_file=$$kernels/gpu_kernels.pb) $$XLA_FLAGS" \
	  || { rm -rf $$cache $$kernels; exit 1; }; \
	$(TEST_ENV) XLA_FLAGS="$$flags" $(BIN)/lit -v tests/lit && \
	$(TEST_ENV) XLA_FLAGS="$$flags" JAX_COMPILATION_CACHE_DIR=$$cache \
	  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 \
	  $(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder tests/py; \
	  status=$$?; rm -rf $$cache $$kernels; exit $$status

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

lint: $(STAMP)
	$(BIN)/ruff check hlo_amp tests benchmarks examples

clean:
	rm -rf $(VENV) out .pytest_cache
