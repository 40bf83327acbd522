# Every target creates or reuses .venv/ through `install`; torch is pinned to the CPU wheel
# when the machine has no NVIDIA GPU (an unpinned torch would pull a multi-GB CUDA build).
PY := .venv/bin/python
STAMP := .venv/.installed
TORCH_CPU := torch==2.13.0

.PHONY: install test serve serve-pd bench lint device-check

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; \
	else \
		$(PY) -m pip install -q $(TORCH_CPU); \
	fi
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

serve: install
	$(PY) -m dsv4 serve $(ARGS)

# Results, JSON per run and PNG plots, go to bench_results/<timestamp>/; ARGS=--quick runs every part smaller.
bench: install
	$(PY) scripts/bench_serving.py --suite $(ARGS)

lint: install
	$(PY) -m ruff check dsv4 tests scripts

device-check: install
	bash scripts/device_check.sh $(ARGS)

# One prefill and one decode instance on this machine (decode serves HTTP on PD_PORT, default 30000),
# each with half of its cores for CPU forwards.
PD_PORT ?= 30000
PD_CPU_THREADS ?= $(shell n=$$(nproc); echo $$(( n > 1 ? n / 2 : 1 )))
serve-pd: install
	$(PY) -m dsv4 serve --disaggregation-mode prefill --disaggregation-bootstrap-port 8998 \
		--cpu-threads $(PD_CPU_THREADS) --port $$(($(PD_PORT) + 1)) $(ARGS) & prefill=$$!; \
	trap 'kill $$prefill' EXIT INT TERM; \
	$(PY) -m dsv4 serve --disaggregation-mode decode --prefill-addr 127.0.0.1:8998 \
		--cpu-threads $(PD_CPU_THREADS) --port $(PD_PORT) $(ARGS)
