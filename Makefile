# The two commands of the README: `make demo` (a completion, then the OpenAI-compatible server on
# 127.0.0.1:8080) and `make test`. Both set up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PLUGINS := $(wildcard plugins/*/pyproject.toml examples/*/pyproject.toml)

$(VENV)/.installed: pyproject.toml $(PLUGINS)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]' $(foreach p,$(dir $(PLUGINS)),-e ./$(p))
	touch $@

.PHONY: demo test
demo: $(VENV)/.installed
	$(VENV)/bin/strata generate --prompt "And the king said" --max-tokens 48 --temperature 0
	$(VENV)/bin/strata serve

test: $(VENV)/.installed
	$(PY) -m pytest
