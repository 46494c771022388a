PYTHON ?= python3

.PHONY: install demo test lint format

install:
	bash scripts/install.sh

demo: install
	$(PYTHON) -m sgl_mmkv.demo

test: install lint
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
