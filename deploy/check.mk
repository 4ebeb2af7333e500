# Offline deploy checks: Helm chart, Prometheus rules, Grafana dashboard, load-test script.
# Included from the top-level Makefile (`include deploy/check.mk`), which defines `install` and VENV.
VENV ?= .venv

.PHONY: deploy-tools check-deploy

# helm -> .tools/bin, promtool (Debian prometheus), locust / kubernetes-validate / promql-parser -> $(VENV).
# Idempotent: a second run only checks versions (< 1 s).
deploy-tools: install
	VENV=$(VENV) bash scripts/install-deploy-tools.sh

check-deploy: deploy-tools
	$(VENV)/bin/python -m pytest -q tests/deploy $(PYTEST_ARGS)
