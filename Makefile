# Both targets create .venv from platform/cpu/ on first use, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

$(STAMP): platform/cpu/requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r platform/cpu/requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hyper-parallel demo

test: $(STAMP)
	$(VENV)/bin/ruff check hyper_parallel tests benchmarks
	$(PY) -m pytest -q -p no:cacheprovider tests

lint: $(STAMP)
	$(VENV)/bin/ruff check hyper_parallel tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
