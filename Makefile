# The few commands everyone uses. Every target installs what it needs into .venv first.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
PROMPT  ?= Explain speculative decoding in two sentences.
MODE    ?= services
SERVE   ?=

.PHONY: install run generate chat test test-fast lint format bench model proto prometheus kubectl clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)          ## fetch the default model once into $$LYANNA_CACHE (default ~/.cache/lyanna)
	$(PY) -m gateway.cli fetch-model

run: model               ## the main job: the chat service on the default model (Ctrl-C stops)
	$(PY) -m gateway.cli serve --mode $(MODE) $(SERVE)

generate: model          ## one chat answer from the default model, no server
	$(PY) -m gateway.cli generate --prompt "$(PROMPT)"

chat: $(STAMP)           ## talk to a running `make run` from a second terminal
	$(PY) -m gateway.cli chat

proto: $(STAMP)          ## regenerate services/pb from proto/ (committed; a test checks they are current)
	$(PY) -m services.protogen

lint: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: $(STAMP)
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

prometheus:              ## the real Prometheus the metrics test scrapes (Debian's package), once
	@command -v prometheus >/dev/null || { \
		SUDO=""; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; \
		$$SUDO apt-get update -qq && \
		$$SUDO apt-get install -y -qq --no-install-recommends prometheus; }

kubectl:                 ## kubectl with kustomize v5 composes deploy/k8s in the tests (the machine image ships it)
	@command -v kubectl >/dev/null || { \
		SUDO=""; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends kubectl; }
	@kubectl version --client | grep -q 'Kustomize Version: v[5-9]' || \
		{ echo "kubectl with kustomize v5 or newer is needed (kubectl 1.27+)"; exit 1; }

test: lint model prometheus kubectl  ## the whole suite, real-model tests included (what CI runs)
	$(PY) -m pytest -q

test-fast: $(STAMP)      ## skip the slow real-model tests
	$(PY) -m pytest -q -m "not slow"

bench: model
	$(PY) -m bench.forward_latency
	$(PY) -m bench.verify_cost

clean:
	rm -rf .venv .pytest_cache .ruff_cache
