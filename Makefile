# The two commands of the README. Each sets up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test test-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py --config configs/default.py --workdir runs/default

test: $(STAMP)
	$(PY) -m pytest -q -n auto

test-quick: $(STAMP)
	$(PY) -m pytest -q -n auto -m "not slow"

clean:
	rm -rf $(VENV)
