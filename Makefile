# The two commands of the README: `make demo` (set up, then run the whole pipeline) and `make test`.
VENV := .venv
INSTALLED := $(VENV)/.loom-installed

.PHONY: demo test lint setup

$(INSTALLED): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

setup: $(INSTALLED)

demo: $(INSTALLED)
	$(VENV)/bin/loom demo

test: $(INSTALLED)
	$(VENV)/bin/python -m pytest -q

lint: $(INSTALLED)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
