# Both targets create .venv from platform/cpu/ on first use, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs venv clean bench bench-smoke

$(STAMP): platform/cpu/requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r platform/cpu/requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hyper-parallel demo

test: $(STAMP)
	$(VENV)/bin/ruff check hyper_parallel tests benchmarks examples
	$(PY) -m pytest -q -p no:cacheprovider tests

# The documentation site into site/, strict: a broken link or a missing API reference fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(VENV)/bin/ruff check hyper_parallel tests benchmarks examples

clean:
	rm -rf $(VENV) build site *.egg-info

# Ours against torch.distributed.pipelining, side by side (docs/performance.md): writes
# benchmarks/results.md and benchmarks/results.json; about 7 minutes. bench-smoke: the same, reduced.
bench: $(STAMP)
	$(PY) benchmarks/bench.py

bench-smoke: $(STAMP)
	$(PY) benchmarks/bench.py --smoke --out build/bench-smoke
