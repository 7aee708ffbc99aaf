# The README's two commands: `make demo` and `make test`. Both set everything up first; setup is
# idempotent (the light venv is stamped, the stack venv and model are checked against pins.toml).
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
KVDRILL := $(BIN)/kvdrill
FLAGSHIP := scenarios/flagship/hit-rate-is-not-correctness.yaml
TWIN     := scenarios/flagship/hit-rate-is-not-correctness-aesgcm.yaml

.PHONY: setup demo test test-unit test-real test-catalogue bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

setup: $(VENV)/.installed
	$(KVDRILL) setup

demo: setup
	@mkdir -p reports/demo
	$(KVDRILL) run $(FLAGSHIP) --reports-dir reports/demo | tee reports/demo/flagship.last
	$(KVDRILL) run $(TWIN) --reports-dir reports/demo | tee reports/demo/twin.last
	@echo
	@echo "== kvdrill demo: the flagship drill and its twin =="
	@cat reports/demo/flagship.last reports/demo/twin.last

# two workers on two cores: the unit suite is CPU-bound (fuzzing, tiny real processes), 4.5 -> 2.4 min here.
# The proxy's conformance tests then run alone: they measure toxics to the millisecond (a 50 ms latency's
# median within 2 ms), and the other worker's load shifted that median by 2.2 ms in CI.
test-unit: $(VENV)/.installed
	$(BIN)/ruff check drills injectors tests bench
	$(BIN)/pytest -q -m "not real" -n 2 --ignore=tests/conformance
	$(BIN)/pytest -q -m "not real" tests/conformance

# one at a time: two drills on 2 cores start four vLLMs at once, and a restart then misses its
# 240 s deadline (measured); --durations shows where the time goes
test-real: setup
	$(BIN)/pytest -q -m "real and not catalogue" --durations=0

test: setup test-unit test-real

# every scenario of the catalogue as one suite (make test runs the controls and one drill per fault
# family), and the real tests make test leaves out (marked `catalogue`): the README lists them and why
test-catalogue: setup
	KVDRILL_FULL_CATALOGUE=1 $(BIN)/pytest -q -m real tests/real/test_catalogue.py --durations=0
	$(BIN)/pytest -q -m "real and catalogue" --durations=0

bench: setup
	$(BIN)/python bench/flagship.py

clean:
	rm -rf $(VENV) reports/*/ reports/sandbox.json
