# Two commands matter: `make serve` (set up, export the default model, serve) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODELS ?= models
STAMP := $(VENV)/.installed

.PHONY: setup export serve test lint proto bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[export,dev]'
	touch $(STAMP)

proto: setup
	$(BIN)/python proto/generate.py

export: setup
	$(BIN)/python -m export --name mha --embed-dim 512 --num-heads 8 --out $(MODELS) --if-missing

serve: export
	$(BIN)/python -m service --model-repository $(MODELS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy service export

test: lint
	$(BIN)/python -m pytest

bench: export
	$(BIN)/python -m tests.bench --model-repository $(MODELS)

clean:
	rm -rf $(VENV) $(MODELS) .pytest_cache .ruff_cache
