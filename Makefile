PYTHON ?= python3
PORT ?= 30000
MODEL ?= models/fidelity-qwen2-vl-marked

.PHONY: install serve demo test test-slow lint format

install:
	bash scripts/install.sh

# The README's run command: install what is missing, then serve the committed model.
serve: install
	@echo "[serve] query it: curl -s http://127.0.0.1:$(PORT)/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"default\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 8}'"
	$(PYTHON) -m sgl_mmkv.launch_server --model-path $(MODEL) --mm-reuse conduit --port $(PORT)

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
