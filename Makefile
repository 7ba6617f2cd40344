VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The dashboard's bundle, served by the control plane at /dashboard/.
DASHBOARD := frontend/dist/index.html
DASHBOARD_SOURCES := $(wildcard frontend/src/*.ts frontend/src/*/*.ts frontend/src/*.css) frontend/index.html \
	frontend/favicon.svg frontend/package.json frontend/package-lock.json frontend/vite.config.ts frontend/tsconfig.json

.PHONY: up test test-fast lint install proto clean bench bench-full

# The serving benchmark (bench/, docs/benchmarks.md): quick on the tiny model, full on the 100 M model.
bench: $(STAMP)
	$(PY) -m bench.run --profile quick --chart docs/benchmark-quick.png --json .diptych/bench/quick.json

bench-full: $(STAMP)
	$(PY) -m bench.run --profile full --chart docs/benchmark-full.png --json .diptych/bench/full.json

# Options of `diptych up` go in ARGS: make up ARGS="--gateway-port 50052 --http-port 8081" (diptych up --help).
up: $(STAMP) $(DASHBOARD)
	$(VENV)/bin/diptych up $(ARGS)

# Lint, format and types: configured in pyproject.toml, run before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The control plane refuses to start on PostgreSQL without a secret key; tests get a throwaway one. Each
# test's time goes to .diptych/test-times.xml (JUnit), from which the tiers below were drawn.
TEST_ENV := DIPTYCH_SECRET_KEY=$${DIPTYCH_SECRET_KEY:-tests-only-insecure-key}
test: lint $(DASHBOARD)
	$(TEST_ENV) $(PY) -m pytest --durations=25 --junitxml=.diptych/test-times.xml

# The unit tier: no e2e, browser, image or slow tests (markers set in tests/conftest.py); no lint first.
test-fast: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -m "not e2e and not browser and not image and not slow" -q

install: $(STAMP) $(DASHBOARD)

$(DASHBOARD): $(DASHBOARD_SOURCES)
	cd frontend && npm ci --no-audit --no-fund --loglevel=error && npm run build

# torch goes first, from the local CPU build; the constraints file keeps every later install from replacing it.
# Then the API contract (proto/, distribution diptych-proto), which the SDK and the server both depend on.
$(STAMP): pyproject.toml sdk/pyproject.toml proto/pyproject.toml constraints.txt
	test -x $(PY) || python3.11 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ./proto
	$(PIP) install -q -c constraints.txt -e ./sdk -e '.[dev]'
	touch $(STAMP)

# The public stubs go to the contract package (proto/src/diptych_proto), the internal ones to diptych_common.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Idiptych_proto/v1=proto/diptych/v1 --python_out=proto/src --pyi_out=proto/src \
		--grpc_python_out=proto/src proto/diptych/v1/inference.proto
	$(PY) -m grpc_tools.protoc -Idiptych_common/proto=proto/diptych/internal --python_out=. --pyi_out=. \
		--grpc_python_out=. proto/diptych/internal/v1/worker.proto proto/diptych/internal/v1/kv_tier.proto

clean:
	rm -rf $(VENV) .diptych frontend/dist
