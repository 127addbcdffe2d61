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

# A test whose xdist worker *process* dies (a native crash) is run once more in a fresh worker; a test
# that fails its assertions is never rerun. Why: full runs here have lost a worker to a crash inside
# XLA or other native code, in a different test each time (segfaults in XLA compilation, an abort in an
# XLA computation, a hang in array_record's thread pool), tests that pass alone; the cause is not found
# yet. A test still running after 600 s (the
# longest take ~100 s) is taken for hung: its worker exits, which counts as such a crash.
RERUN_CRASHES := --reruns 1 --only-rerun "worker 'gw[0-9]+' crashed" --timeout 600 --timeout-method thread

test: $(STAMP)
	$(PY) -m pytest -q -n auto $(RERUN_CRASHES)

test-quick: $(STAMP)
	$(PY) -m pytest -q -n auto -m "not slow" $(RERUN_CRASHES)

clean:
	rm -rf $(VENV)
