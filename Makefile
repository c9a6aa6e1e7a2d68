# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and reuse it
# while pyproject.toml is unchanged.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OUT := out

.PHONY: demo test bench bench-big clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[torch,test]'
	touch $(STAMP)

demo: $(STAMP)
	bash examples/demo.sh $(BIN) $(OUT)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests

# The benchmarks of benchmarks/README.md (the 1,024-worker library takes minutes: bench-big).
bench: $(STAMP)
	cd benchmarks && ../$(BIN)/python bench_core.py
	cd benchmarks && ../$(BIN)/python bench_planner.py optimality
	cd benchmarks && ../$(BIN)/python bench_planner.py quality
	cd benchmarks && ../$(BIN)/python bench_planner.py speed
	cd benchmarks && ../$(BIN)/python bench_whatif.py

bench-big: $(STAMP)
	cd benchmarks && ../$(BIN)/python bench_planner.py speed --big

clean:
	rm -rf $(VENV) $(OUT)
