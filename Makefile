# nextoken: `make run` answers a prompt with the default model; `make test` runs the tests.
# Both create .venv when missing and install what they need (torch pinned to the local CPU build).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  := torch==2.13.0
MODEL  ?= smollm2-135m-instruct
PROMPT ?= What is gravity?
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: run test install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(TORCH) -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(TORCH) -e '.[test]'
	touch $(VENV)/.installed $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(BIN)/nextoken pull $(MODEL)
	$(BIN)/nextoken run "$(PROMPT)" --model $(MODEL) $(ARGS)

# PYTHONDONTWRITEBYTECODE emptied: the tests start dozens of Python processes (the CLI, servers, ranks,
# bench workers), and with bytecode caching off (this VM's default) each compiled nextoken's source again
test: install-test
	$(BIN)/nextoken pull smollm2-135m-instruct
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
