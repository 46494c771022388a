PYTHON ?= python3
PORT ?= 30000
MODEL ?= models/fidelity-qwen2-vl-marked

.PHONY: install serve ask demo test test-slow lint format

install:
	bash scripts/install.sh

# The README's run command: install what is missing, then serve the committed model
# (--mm-report-reuse: each answer says what it reused; `make ask` shows it).
serve: install
	@echo "[serve] once it is up, in another shell: make ask  (PORT=$(PORT))"
	$(PYTHON) -m sgl_mmkv.launch_server --model-path $(MODEL) --mm-reuse conduit --mm-report-reuse --port $(PORT)

# Ask the server `make serve` started: two images and the task's question, under two
# system prompts; the second reuses both images' KV although its prefix changed.
ask:
	$(PYTHON) -m harness.ask --port $(PORT) --model-path $(MODEL)

demo: install
	$(PYTHON) -m harness.demo

# What CI runs (.ci/run): lint, then every test not marked slow, on two workers
# (a test module stays on one worker, so its server starts once).
test: install lint
	$(PYTHON) -m pytest -q -m "not slow" -n 2 --dist loadfile --durations=25

# The slow tests only (training runs and benchmark scripts end to end).
test-slow: install
	$(PYTHON) -m pytest -q -m slow

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
