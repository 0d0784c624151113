# Each target bootstraps .venv itself: on a fresh clone `make serve` / `make test` is the whole set-up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 50051
HTTP_PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: venv kernels serve test test-slow bench bench-scale soak clean

venv: $(STAMP)

# torch==2.13.0 goes first: a CPU wheel lies on disk, and letting pip resolve a bare
# `torch` (through peft, say) would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The C++ CPU kernels (kernel_backends/cpu/csrc), built once per machine into torch's extension cache
# (minutes on 2 cores; a no-op afterwards), so no test, server start or benchmark pays for it.
kernels: $(STAMP)
	$(PY) -m loraplex.kernel_backends.cpu

serve: kernels
	$(VENV)/bin/loraplex serve --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT) $(SERVE_ARGS)

test: kernels
	$(PY) -m pytest -q -m "not slow" --durations=30 $(PYTEST_ARGS)

# the tests marked slow (soak-like runs, whole-GGUF reads, Ray autoscaling and clusters),
# none of which `make test` runs
test-slow: kernels
	$(PY) -m pytest -q -m slow --durations=30 $(PYTEST_ARGS)

# the serving benchmark with its baselines (~15 min on 2 cores): benchmarks/results/<date>.{json,md,png}
bench: kernels
	$(PY) -m loraplex.benchmarks.run_all $(BENCH_ARGS)

# the scale benchmark (~20 min on 2 cores): 8 to 1,000 registered adapters at a fixed
# Poisson rate, benchmarks/results/<date>-scale.{json,md,png}; BENCH_ARGS="--max-loras 16,32
# --ns 8,64 --num-prompts 20" for a short one
bench-scale: kernels
	$(PY) -m loraplex.benchmarks.scale $(BENCH_ARGS)

# Churn soak against a real server (~5 minutes): SOAK_ARGS="--duration 60" for a short one.
soak: kernels
	$(PY) -m loraplex.benchmarks.soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
