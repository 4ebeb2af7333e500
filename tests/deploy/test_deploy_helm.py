"""The Helm chart, checked with the real helm binary and kubernetes-validate (no cluster needed)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from deploytools import CHART, DASHBOARD, RULES, VALUES_FILES, find_tool

H100 = "NVIDIA-H100-80GB-HBM3"
# API groups whose schemas ship with kubernetes-validate; CRDs (monitoring.coreos.com, keda.sh) are checked below.
CORE_GROUPS = {"v1", "apps", "batch", "policy", "autoscaling", "networking.k8s.io", "rbac.authorization.k8s.io"}
EXPECTED_GPUS = {
    "default": 1,
    "h100-production": 4,
    "multi-replica-autoscale-monitoring": 1,
    "moa-trained": 1,
    "moa-training-job": 1,
}
# the values files that set runtimeClassName: nvidia (the others leave the cluster's default)
NVIDIA_RUNTIME = {"h100-production", "multi-replica-autoscale-monitoring"}
ALL_VALUES = pytest.mark.parametrize("values", list(VALUES_FILES))


def by_kind(objs, kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs, kind: str, suffix: str = "") -> dict:
    found = [o for o in by_kind(objs, kind) if o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"want one {kind} *{suffix}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def sglang(objs) -> dict:
    (workload,) = [
        o for o in objs if o["kind"] in ("Deployment", "StatefulSet") and o["metadata"]["name"].endswith("-sglang")
    ]
    return workload


def container(workload: dict, name: str) -> dict:
    (c,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def env_of(c: dict) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


def pod_specs(objs):
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


# --- lint, render, schema validation -------------------------------------------------------------------


@ALL_VALUES
def test_helm_lint_strict(helm, values):
    path = VALUES_FILES[values]
    proc = helm.run("lint", "--strict", str(CHART), *(("-f", str(path)) if path else ()))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


@ALL_VALUES
@pytest.mark.parametrize("k8s", ["1.27.0", "1.30.0", "1.37.0"])  # Chart.yaml's kubeVersion floor .. newest bundled
def test_kubernetes_validate_strict_on_core_objects(helm, values, k8s, tmp_path):
    objs = helm.render_values(values)
    core = [o for o in objs if o["apiVersion"].split("/")[0] in CORE_GROUPS]
    assert len(core) == len([o for o in objs if "coreos" not in o["apiVersion"] and "keda" not in o["apiVersion"]])
    manifest = tmp_path / f"{values}.yaml"
    manifest.write_text(yaml.safe_dump_all(core))
    proc = subprocess.run(
        [find_tool("kubernetes-validate"), "--strict", "-k", k8s, "--quiet", str(manifest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_schema_rejects_bad_values(helm):
    for args, message in [
        (("--set", "drafter.algorithm=MEDUSA"), "drafter.algorithm"),
        (("--set", "sglang.gpus=0"), "sglang.gpus"),
        (("--set", "gateway.replicas=3"), "Additional property replicas"),
        (("--set", "autoscaling.mode=vpa"), "autoscaling.mode"),
        (("--set", "gateway.admission.maxRunning=0"), "gateway.admission.maxRunning"),
    ]:
        proc = helm.template(*args)
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr)


# --- SGLang server pods ----------------------------------------------------------------------------------


@ALL_VALUES
def test_sglang_gpus_and_h100_scheduling(helm, values):
    pod = sglang(helm.render_values(values))["spec"]["template"]["spec"]
    res = container({"spec": {"template": {"spec": pod}}}, "sglang")["resources"]
    gpus = EXPECTED_GPUS[values]
    assert res["requests"]["nvidia.com/gpu"] == gpus and res["limits"]["nvidia.com/gpu"] == gpus
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == H100
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container({"spec": {"template": {"spec": pod}}}, "sglang")[
        "volumeMounts"
    ]
    assert pod.get("runtimeClassName") == ("nvidia" if values in NVIDIA_RUNTIME else None)


def test_production_affinity_and_tensor_parallel(helm):
    workload = sglang(helm.render_values("h100-production"))
    assert workload["kind"] == "StatefulSet" and workload["spec"]["replicas"] == 2
    pod = workload["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["key"] == "nvidia.com/gpu.count"
    assert "podAntiAffinity" in pod["affinity"]
    args = container(workload, "sglang")["args"]
    assert "--tp-size=4" in args and "--speculative-algorithm=EAGLE3" in args
    assert not any(a.startswith("--moa") for a in args)
    assert "MOA_SGLANG_TLI" not in {e["name"] for e in container(workload, "sglang")["env"]}


@ALL_VALUES
def test_sglang_probes_on_health(helm, values):
    c = container(sglang(helm.render_values(values)), "sglang")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60, "weights + CUDA graphs need minutes"
    assert {"name": "http", "containerPort": 30000, "protocol": "TCP"} in c["ports"]


def test_sglang_speculative_args(helm):
    """The default: the public EAGLE-3 head for the default target, both downloaded onto the cache by the init
    step; helm/ci/moa-trained.yaml: MoA from the training Job's head."""
    c = container(sglang(helm.render_values("default")), "sglang")
    for want in (
        "--model-path=/models/meta-llama/Llama-3.1-8B-Instruct",
        "--served-model-name=meta-llama/Llama-3.1-8B-Instruct",
        "--speculative-algorithm=EAGLE3",
        "--speculative-draft-model-path=/models/lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B",
        "--speculative-num-steps=5",
        "--speculative-eagle-topk=4",
        "--speculative-num-draft-tokens=8",
        "--enable-metrics",
        "--port=30000",
    ):
        assert want in c["args"], want
    assert "MOA_SGLANG_TLI" not in env_of(c)
    moa = container(sglang(helm.render_values("moa-trained")), "sglang")
    assert {"name": "MOA_SGLANG_TLI", "value": "1"} in moa["env"]  # the plugin's TLI setting
    assert "--speculative-algorithm=MOA" in moa["args"]
    assert (
        "--speculative-draft-model-path=/models/drafters/moa-llama-3.1-8b-instruct-tli1/run/heads/moa-tli1"
        in (moa["args"])
    )
    vanilla = container(sglang(helm.render_values("default", "--set", "drafter.algorithm=NONE")), "sglang")["args"]
    assert not any(a.startswith("--speculative") or a.startswith("--moa") for a in vanilla)


def test_model_cache_variants(helm):
    # default: a Deployment with one chart-made PVC
    objs = helm.render_values("default")
    pvc = one(objs, "PersistentVolumeClaim", "-model-cache")
    (vol,) = [v for v in sglang(objs)["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-cache"]
    assert vol["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    # production: a StatefulSet with a claim per replica and the init step filling it
    prod = sglang(helm.render_values("h100-production"))
    assert not by_kind(helm.render_values("h100-production"), "PersistentVolumeClaim")
    assert prod["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "400Gi"
    (init,) = prod["spec"]["template"]["spec"]["initContainers"]
    assert env_of(init)["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    args = container(prod, "sglang")["args"]
    assert "--model-path=/models/meta-llama/Llama-3.3-70B-Instruct" in args
    assert env_of(container(prod, "sglang"))["HF_HUB_OFFLINE"]["value"] == "1"
    # hostPath
    host = sglang(helm.render_values("default", "--set", "modelCache.type=hostPath"))
    (vol,) = [v for v in host["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-cache"]
    assert vol["hostPath"] == {"path": "/mnt/models", "type": "DirectoryOrCreate"}


def test_replicas_cannot_share_a_readwriteonce_cache(helm):
    proc = helm.template("--set", "sglang.replicaCount=2")
    assert proc.returncode != 0 and "ReadWriteOnce" in proc.stderr
    assert helm.template("--set", "sglang.replicaCount=2", "--set", "sglang.kind=StatefulSet").returncode == 0


# --- gateway ---------------------------------------------------------------------------------------------


@ALL_VALUES
def test_no_secret_is_ever_rendered(helm, values):
    assert not by_kind(helm.render_values(values), "Secret")


def test_api_keys_come_from_the_existing_secret(helm):
    gw = one(helm.render_values("h100-production"), "Deployment", "-gateway")
    c = container(gw, "gateway")
    keys_file = env_of(c)["MOA_SERVE_API_KEYS_FILE"]["value"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "api-keys"]
    assert mount["readOnly"] is True and keys_file == f"{mount['mountPath']}/api-keys"
    (vol,) = [v for v in gw["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys"]
    assert vol["secret"]["secretName"] == "moa-serve-api-keys"
    assert vol["secret"]["items"] == [{"key": "api-keys", "path": "api-keys"}]

    default = container(one(helm.render_values("default"), "Deployment", "-gateway"), "gateway")
    assert "MOA_SERVE_API_KEYS_FILE" not in env_of(default)


def test_gateway_admission_limits(helm):
    """gateway.admission sets the gateway's fair admission in front of SGLang (--max-running, --max-queue)."""
    default = container(one(helm.render_values("default"), "Deployment", "-gateway"), "gateway")
    assert "--max-running=64" in default["args"] and "--max-queue=256" in default["args"]
    objs = helm.render("--set", "gateway.admission.maxRunning=8", "--set", "gateway.admission.maxQueue=0")
    args = container(one(objs, "Deployment", "-gateway"), "gateway")["args"]
    assert "--max-running=8" in args and "--max-queue=0" in args


def test_ingress_requires_api_keys(helm):
    proc = helm.template("--set", "gateway.ingress.enabled=true")
    assert proc.returncode != 0 and "gateway.apiKeys.existingSecret" in proc.stderr
    objs = helm.render("--set", "gateway.ingress.enabled=true", "--set", "gateway.apiKeys.allowUnauthenticated=true")
    assert one(objs, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"] == {
        "name": "http"
    }


@ALL_VALUES
def test_gateway_service_and_upstream(helm, values):
    objs = helm.render_values(values)
    svc = one(objs, "Service", "-gateway")
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["ports"][0]["port"] == 8000
    c = container(one(objs, "Deployment", "-gateway"), "gateway")
    upstream = (
        "http://moa-moa-serve-router:30000" if values.startswith("multi") else "http://moa-moa-serve-sglang:30000"
    )
    assert f"--upstream={upstream}" in c["args"] and "--backend=sglang" in c["args"]
    assert env_of(c)["MOA_SERVE_UPSTREAM"]["value"] == upstream
    assert c["livenessProbe"]["httpGet"]["path"] == "/health" and c["readinessProbe"]["httpGet"]["path"] == "/ready"
    one(objs, "Service", "-sglang")  # the upstream Service exists


@ALL_VALUES
def test_pods_run_as_non_root(helm, values):
    for name, pod in pod_specs(helm.render_values(values)):
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert not sc.get("privileged"), (name, c["name"])
        if not name.endswith("-router"):  # only the router talks to the API server
            assert pod["automountServiceAccountToken"] is False, name


@ALL_VALUES
def test_pod_disruption_budgets_select_their_pods(helm, values):
    objs = helm.render_values(values)
    pdbs = by_kind(objs, "PodDisruptionBudget")
    assert {p["metadata"]["name"].rsplit("-", 1)[1] for p in pdbs} == {"sglang", "gateway"}
    workloads = {o["metadata"]["name"]: o for o in objs if o["kind"] in ("Deployment", "StatefulSet")}
    for pdb in pdbs:
        assert pdb["spec"]["selector"] == workloads[pdb["metadata"]["name"]]["spec"]["selector"]


# --- optional parts: off by default, on in the multi-replica file -----------------------------------------

OPTIONAL_KINDS = (
    "Job",
    "Ingress",
    "HorizontalPodAutoscaler",
    "ScaledObject",
    "ServiceMonitor",
    "PrometheusRule",
    "ConfigMap",
    "Role",
)


def test_optional_parts_off_by_default(helm):
    objs = helm.render_values("default")
    for kind in OPTIONAL_KINDS:
        assert not by_kind(objs, kind), kind
    assert not [o for o in objs if o["metadata"]["name"].endswith("-router")]
    assert sglang(objs)["spec"]["replicas"] == 1


def test_router_autoscaling_and_monitoring_on(helm):
    objs = helm.render_values("multi-replica-autoscale-monitoring")
    workload = sglang(objs)
    assert "replicas" not in workload["spec"], "the autoscaler owns the replica count"

    scaled = one(objs, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": workload["metadata"]["name"],
    }
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 8)
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "4"
    assert trigger["metadata"]["query"] == 'sum(moa_queued_requests{namespace="llm", job="moa-moa-serve-gateway"})'

    router = container(one(objs, "Deployment", "-router"), "router")
    assert "--service-discovery" in router["args"] and "--service-discovery-namespace=llm" in router["args"]
    assert "app.kubernetes.io/component=sglang" in router["args"]
    assert one(objs, "Role")["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]

    monitors = {m["metadata"]["name"].rsplit("-", 1)[1]: m for m in by_kind(objs, "ServiceMonitor")}
    assert set(monitors) == {"gateway", "sglang", "router"}
    for m in monitors.values():
        assert m["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert m["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitors["router"]["spec"]["endpoints"][0]["port"] == "metrics"


def test_hpa_mode(helm):
    objs = helm.render_values(
        "default",
        "--set",
        "autoscaling.enabled=true",
        "--set",
        "autoscaling.mode=hpa",
        "--set",
        "sglang.kind=StatefulSet",
    )
    assert not by_kind(objs, "ScaledObject")
    hpa = one(objs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External" and metric["external"]["metric"]["name"] == "moa_queued_requests"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "4"}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 900


def test_headless_service_is_not_scraped_twice(helm):
    objs = helm.render_values("h100-production")
    headless = one(objs, "Service", "-sglang-headless")
    monitor = one(objs, "ServiceMonitor", "-sglang")
    assert headless["metadata"]["labels"]["moa-serve/headless"] == "true"
    assert {"key": "moa-serve/headless", "operator": "DoesNotExist"} in monitor["spec"]["selector"]["matchExpressions"]


# --- the chart ships deploy/'s dashboard and rules, unchanged ----------------------------------------------


def test_chart_files_are_the_deploy_files():
    for chart_file, source in [
        (CHART / "files" / "moa-serve-dashboard.json", DASHBOARD),
        (CHART / "files" / "prometheus-rules.yaml", RULES),
    ]:
        assert chart_file.read_bytes() == source.read_bytes(), f"{chart_file} drifted from {source}"


def test_rendered_rules_and_dashboard_match_sources(helm):
    objs = helm.render_values("multi-replica-autoscale-monitoring")
    rule = one(objs, "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    cm = one(objs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (data,) = cm["data"].values()
    assert json.loads(data) == json.loads(DASHBOARD.read_text())
    assert data == DASHBOARD.read_text().rstrip("\n")


@ALL_VALUES
def test_gateway_command_and_env_are_what_moa_serve_takes(helm, values):
    """The chart's gateway container runs `moa-serve serve` with flags the command line accepts (its own
    parser reads them) and sets only MOA_* variables the settings know, with values they accept."""
    from moa_serve.entrypoints.cli import build_parser
    from serving.gateway import settings as gateway_settings_mod
    from sglang_ext import settings as settings_mod

    c = container(one(helm.render_values(values), "Deployment", "-gateway"), "gateway")
    assert c["command"] == ["moa-serve", "serve"]
    args = build_parser().parse_args(["serve", *c["args"]])  # an unknown flag or bad value: SystemExit
    assert args.backend == "sglang" and args.upstream and args.host == "0.0.0.0"
    env = {k: e["value"] for k, e in env_of(c).items() if k.startswith("MOA_") and "value" in e}
    # the core's variables and the gateway's, each documented (and parsed) by its own settings module
    documented = {m: set(re.findall(r"\b(MOA_[A-Z0-9_]+)\b", m.__doc__)) for m in (settings_mod, gateway_settings_mod)}
    assert env and set(env) <= set().union(*documented.values()), set(env) - set().union(*documented.values())
    settings_mod.parse_settings({k: v for k, v in env.items() if k in documented[settings_mod]})  # else SettingsError
    gateway_settings_mod.parse_gateway_settings({k: v for k, v in env.items() if k in documented[gateway_settings_mod]})


# --- weights: every one a release loads is downloaded or trained --------------------------------------------


def _job(objs) -> tuple[dict, dict]:
    """The training Job's container and its environment (name -> value)."""
    c = container(one(objs, "Job", "-training"), "training")
    return c, {e["name"]: e["value"] for e in c["env"] if "value" in e}


def _job_commands(c: dict, env: dict) -> dict[str, list[str]]:
    """The Job script's `moa-serve distill` and `torchrun` command lines, variables substituted, split as sh would."""
    import shlex

    script = re.sub(r"\\\n\s*", " ", c["command"][2])
    (out,) = re.findall(r'^out="(.+)"$', script, re.M)
    values = env | {"out": out.replace("$MODEL_CACHE", env["MODEL_CACHE"]).replace("$RUN_NAME", env["RUN_NAME"])}
    lines = {}
    for line in script.splitlines():
        words = shlex.split(re.sub(r"\$(\w+)", lambda m: values[m.group(1)], line.strip()))
        if words[:2] == ["moa-serve", "distill"] or words[:1] == ["torchrun"]:
            lines[words[0]] = words
    return lines


@ALL_VALUES
def test_every_weight_a_release_loads_is_downloaded_or_trained(helm, values):
    """The target and the drafter each are a repo id that the init step downloads to the path the server loads,
    or the servable head that this release's training Job writes onto the cache (the same head kind)."""
    objs = helm.render_values(values)
    pod = sglang(objs)["spec"]["template"]["spec"]
    flags = dict(a.split("=", 1) for a in container(sglang(objs), "sglang")["args"] if "=" in a)
    init = [c for c in pod.get("initContainers", []) if c["name"] == "fetch-weights"]
    downloaded = {env_of(init[0])[k]["value"] for k in ("TARGET_MODEL", "DRAFT_MODEL")} - {""} if init else set()
    for flag in ("--model-path", "--speculative-draft-model-path"):
        if flag not in flags:
            continue
        path = flags[flag]
        assert path.startswith("/models/"), f"{values}: {flag} {path} is not on the model cache"
        if path.removeprefix("/models/") in downloaded:
            assert env_of(init[0])["MODEL_CACHE"]["value"] == "/models"
            continue
        c, env = _job(helm.render_values(values, "--set", "training.enabled=true"))
        (head,) = re.findall(r"servable head: \$out/run/heads/([\w.-]+)", c["command"][2])
        written = f"{env['MODEL_CACHE']}/drafters/{env['RUN_NAME']}/run/heads/{head}"
        assert path == written, f"{values}: {flag} {path}: neither downloaded by the init step nor the Job's {written}"
        algorithm = flags["--speculative-algorithm"]
        assert (algorithm, head) in (
            ("EAGLE3", "eagle3"),
            ("MOA", f"moa-tli{env_of(container(sglang(objs), 'sglang'))['MOA_SGLANG_TLI']['value']}"),
        )


def test_the_training_job(helm):
    from moa_serve.entrypoints.cli import build_parser

    objs = helm.render_values("moa-training-job")
    job = one(objs, "Job", "-training")
    pod = job["spec"]["template"]["spec"]
    c, env = _job(objs)
    assert job["spec"]["backoffLimit"] == 6 and pod["restartPolicy"] == "OnFailure"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert env["GPUS"] == "8" and env["BASE_URL"] == "http://moa-moa-serve-sglang:30000"
    assert env["TARGET"] == "/models/meta-llama/Llama-3.1-8B-Instruct" and env["HF_HUB_OFFLINE"] == "1"
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == H100
    (cache,) = [v for v in pod["volumes"] if v["name"] == "model-cache"]
    (served,) = [v for v in sglang(objs)["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-cache"]
    assert cache == served, "the Job writes where the servers read"
    lines = _job_commands(c, env)
    distill, torchrun = lines["moa-serve"], lines["torchrun"]
    assert distill[distill.index("--base-url") + 1] == env["BASE_URL"] and "--resume" in distill
    assert torchrun[:4] == ["torchrun", "--standalone", "--nproc-per-node", "8"]
    train = torchrun[torchrun.index("moa_serve.entrypoints.cli") + 1 :]
    assert train[:4] == ["train", "moa", "--tli", "1"] and "--resume" in train and "--epochs=2" in train
    for argv in (distill[1:], train):  # flags `moa-serve` takes (its own parser; a bad one is SystemExit)
        build_parser().parse_args(argv)
    # the router in front: answers through it; an EAGLE-3 head: `train eagle3`
    routed = _job(helm.render_values("multi-replica-autoscale-monitoring", "--set", "training.enabled=true"))[1]
    assert routed["BASE_URL"] == "http://moa-moa-serve-router:30000"
    c3, env3 = _job(helm.render_values("moa-training-job", "--set", "training.head=eagle3"))
    assert _job_commands(c3, env3)["torchrun"][6:8] == ["train", "eagle3"]


def test_the_training_job_needs_the_servers_cache(helm):
    for args, message in [
        (("--set", "modelCache.type=emptyDir"), "modelCache.type must be pvc or hostPath"),
        (("--set", "sglang.kind=StatefulSet"), "modelCache.pvc.existingClaim"),
        (("--set", "training.head=medusa"), "training.head"),
    ]:
        proc = helm.template("--set", "training.enabled=true", *args)
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr)
    shared = ("--set", "sglang.kind=StatefulSet", "--set", "modelCache.pvc.existingClaim=models")
    assert helm.template("--set", "training.enabled=true", *shared).returncode == 0
