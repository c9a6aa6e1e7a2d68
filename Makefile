# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and reuse it
# while pyproject.toml is unchanged.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OUT := out

.PHONY: demo test bench bench-big bench-control etcd clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[torch,test,etcd]'
	touch $(STAMP)

demo: $(STAMP)
	bash examples/demo.sh $(BIN) $(OUT)

test: $(STAMP) etcd
	$(BIN)/python -m pytest -q -n 2 tests

# The control-plane tests start a real etcd (Debian's etcd-server) on loopback ports. Installed
# here when missing and this runs as root with apt-get (as CI does); otherwise those tests are
# skipped with the reason printed and everything else runs.
etcd:
	@if command -v etcd >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing etcd-server (apt-get)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    etcd-server >/dev/null; } || echo "could not install etcd-server: the etcd tests are skipped"; \
	else echo "etcd is not installed and this is not root with apt-get: the etcd tests are skipped"; fi

# The benchmarks of benchmarks/README.md (the 1,024-worker library takes minutes: bench-big).
bench: $(STAMP)
	cd benchmarks && ../$(BIN)/python bench_core.py
	cd benchmarks && ../$(BIN)/python bench_planner.py optimality
	cd benchmarks && ../$(BIN)/python bench_planner.py quality
	cd benchmarks && ../$(BIN)/python bench_planner.py speed
	cd benchmarks && ../$(BIN)/python bench_whatif.py

# The control plane at 1,024 and 8,192 ranks on a real 3-member etcd (needs etcd: make etcd).
bench-control: $(STAMP) etcd
	cd benchmarks && ../$(BIN)/python bench_control.py

bench-big: $(STAMP)
	cd benchmarks && ../$(BIN)/python bench_planner.py speed --big

clean:
	rm -rf $(VENV) $(OUT)
