# The commands of the README (`make demo`, `make test`, `make lint`) do all the set-up themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Development installs every extra ([plan], [sim], [report]) and the test tools ([dev]).
# The CPU build of torch 2.13.0 is installed first and pinned; the package's own range is
# then already satisfied, so pip never pulls a CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: install demo test lint scenarios clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev,plan,sim,report,examples]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/unbroken demo

test: install
	$(PY) -m pytest -q -p no:cacheprovider

lint: install
	$(VENV)/bin/ruff format --check unbroken tests examples
	$(VENV)/bin/ruff check unbroken tests examples
	$(VENV)/bin/mypy

# The long end-to-end scenarios the suite leaves out (about 5 minutes on 2 cores).
scenarios: install
	$(PY) -m pytest -q -p no:cacheprovider -m scenario

clean:
	rm -rf $(VENV) build *.egg-info
