VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: up test install proto clean

up: $(STAMP)
	$(VENV)/bin/diptych up

# The control plane refuses to start on PostgreSQL without a secret key; tests get a throwaway one.
test: $(STAMP)
	DIPTYCH_SECRET_KEY=$${DIPTYCH_SECRET_KEY:-tests-only-insecure-key} $(PY) -m pytest

install: $(STAMP)

# torch goes first, from the local CPU build; the constraints file keeps every later install from replacing it.
$(STAMP): pyproject.toml sdk/pyproject.toml constraints.txt
	test -x $(PY) || python3.11 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ./sdk -e '.[dev]'
	touch $(STAMP)

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Idiptych/_proto=proto/diptych --python_out=sdk/src --pyi_out=sdk/src \
		--grpc_python_out=sdk/src proto/diptych/v1/inference.proto
	$(PY) -m grpc_tools.protoc -Idiptych_common/proto=proto/diptych/internal --python_out=. --pyi_out=. \
		--grpc_python_out=. proto/diptych/internal/v1/worker.proto

clean:
	rm -rf $(VENV) .diptych
