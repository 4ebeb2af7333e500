"""deploy/Dockerfile replayed without a container engine, then the chart's commands run in what it installed.

The base image (lmsysorg/sglang) is stood in for by a fresh venv whose pre-installed layer is sglang and everything
it requires, as installed here (tests/freshvenv.py): the versions SGLang pins for torch, transformers, xgrammar
(checked below) are the lock's. The replay then does what the Dockerfile says, instruction by instruction: WORKDIR
and COPY (the files a clone has, into a stand-in for the image's filesystem) and each RUN that installs, with
pip offline from the wheelhouse (`make install`); the RUN that adds the uid 1000 user is the one step not
replayed (it changes this machine's users). A COPY that misses a package, a pip line that misses a
dependency, or a console script that points outside what was installed fails here.

In that venv, with the commands the chart renders (helm template):
    the gateway pod   `moa-serve serve --backend sglang ...` answers a chat request through the fake SGLang upstream
                      of tests/serving/test_gateway_sglang.py;
    the router pod    `python3 -m sglang_router.launch_router`: the module imports and its parser takes the
                      chart's arguments (sglang-router is a binary abi3 wheel: it installs offline);
    the training Job  its exact script (distill through a server on loopback, torchrun with 2 gloo ranks on a
                      small random target) writes a MoA head to the model cache;
    the SGLang pods   `load_plugins()` registers MOA from the installed entry point, and the plugin's loader
                      reads the Job's head (every weight consumed) and accepts it for the target.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from deploytools import ROOT
from freshvenv import WHEELHOUSE, clean_env, fresh_venv, installed_closure, preinstalled_layer, tracked_copy

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
# what the base image already has: sglang and its requirements (as installed here), pip to install with, and
# what sglang's modules import without declaring it (the image has dill through sglang's `datasets`, which is
# not installed here; loguru through its extras)
BASE_IMAGE = ["sglang", "pip", "dill", "loguru"]
SKIPPED_RUN = re.compile(r"getent group 1000 .* useradd ")  # the image's user: not replayed on this machine

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of each Dockerfile instruction, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    return [(s.split(None, 1)[0].upper(), s.split(None, 1)[1]) for s in map(str.strip, joined.splitlines()) if s]


def replay(text: str, root: Path, python: Path) -> tuple[Path, list[str]]:
    """Replay a Dockerfile into the venv of `python`; the image's filesystem is `root`. (WORKDIR, skipped RUNs)"""
    workdir, skipped = Path("/"), []
    root.mkdir(parents=True, exist_ok=True)
    # pip offline from the wheelhouse; PIP_NO_COMPILE: no bytecode for modules the test never imports (not semantic)
    offline = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(WHEELHOUSE), "PIP_NO_COMPILE": "1"}
    env = clean_env(PATH=f"{python.parent}:{os.environ['PATH']}", HOME="/tmp", **offline)
    for keyword, args in instructions(text):
        here = root / str(workdir).lstrip("/")
        if keyword == "WORKDIR":
            workdir = workdir / args
            (root / str(workdir).lstrip("/")).mkdir(parents=True, exist_ok=True)
        elif keyword == "COPY":
            *sources, dest = args.split()
            for src in sources:
                if not (ROOT / src).exists():
                    raise AssertionError(f"COPY {src}: not in the repository")
                staged = tracked_copy(root / ".context", [src])  # the build context: what a clone has
                target = here / dest if (ROOT / src).is_dir() or dest.endswith("/") else here / dest / Path(src).name
                shutil.copytree(staged / src, target, dirs_exist_ok=True) if (ROOT / src).is_dir() else (
                    target.parent.mkdir(parents=True, exist_ok=True),
                    shutil.copy2(staged / src, target),
                )
        elif keyword == "RUN":
            if SKIPPED_RUN.search(args):
                skipped.append(args)
                continue
            command = args.replace(str(workdir), str(here))  # the image's absolute paths, in the stand-in
            proc = subprocess.run(
                ["sh", "-ec", command], cwd=here, env=env, capture_output=True, text=True, timeout=600
            )
            assert proc.returncode == 0, f"RUN {args}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        elif keyword not in ("ARG", "FROM", "USER", "ENV", "EXPOSE", "CMD", "LABEL"):
            raise AssertionError(f"the replay does not know the Dockerfile instruction {keyword}")
    return root / str(workdir).lstrip("/"), skipped


def sglang_requirements() -> list:
    """sglang's own requirements (what the base image installs), from its installed metadata."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    reqs = map(Requirement, requires("sglang") or [])
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """The image's venv: its python, its environment for commands, its WORKDIR."""
    tmp = tmp_path_factory.mktemp("image")
    layer = preinstalled_layer(tmp / "base", BASE_IMAGE)
    python = fresh_venv(tmp / "venv", layer)
    workdir, skipped = replay(DOCKERFILE.read_text(), tmp / "root", python)
    assert len(skipped) == 1, skipped
    env = clean_env(PATH=f"{python.parent}:{os.environ['PATH']}", HOME=str(tmp / "home"))
    return python, env, workdir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def container(objs, kind: str, suffix: str, name: str) -> dict:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    (c,) = [c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def _fake_sglang():
    """tests/serving/test_gateway_sglang.py's FakeSGLang (an OpenAI-API server speaking as SGLang 0.5.23 does)."""
    path = ROOT / "tests" / "serving" / "test_gateway_sglang.py"
    spec = importlib.util.spec_from_file_location("fake_sglang_upstream", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_base_layer_is_sglangs_pins():
    """The stand-in base has the versions SGLang requires (its pins of torch, transformers, tokenizers, xgrammar,
    openai, ...): every requirement of sglang that is installed here is satisfied."""
    dists, _ = installed_closure(["sglang"])
    have = {d.metadata["Name"].lower(): d.version for d in dists}
    wrong = {
        str(r): have[r.name.lower()]
        for r in sglang_requirements()
        if r.name.lower() in have and not r.specifier.contains(have[r.name.lower()], prereleases=True)
    }
    assert not wrong, f"installed here against sglang's requirements: {wrong} (run make install)"
    assert {"torch", "transformers", "tokenizers", "xgrammar"} <= have.keys()


def test_the_installed_package_is_the_three_packages(image):
    python, env, _ = image
    code = (
        "import importlib.metadata as m, json; d = m.distribution('moa-serve'); "
        "print(json.dumps({'tops': sorted({str(f).split('/')[0] for f in d.files}), "
        "'script': [e.value for e in d.entry_points if e.name == 'moa-serve']}))"
    )
    out = json.loads(subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
    tops = {t for t in out["tops"] if not t.endswith((".dist-info", ".pth")) and t != ".."}
    assert tops == {"sglang_ext", "serving", "moa_serve"}, tops
    assert out["script"] == ["moa_serve.entrypoints.cli:main"]


def test_the_gateway_pod_serves_through_the_upstream(image, helm, tmp_path):
    python, env, _ = image
    fake = _fake_sglang()
    upstream = fake.FakeSGLang()
    c = container(helm.render(), "Deployment", "-gateway", "gateway")
    port = free_port()
    with fake.ServerThread(upstream.app) as srv:
        args = [a for a in c["args"] if not a.startswith(("--host=", "--port=", "--upstream="))]
        args += ["--host=127.0.0.1", f"--port={port}", f"--upstream={srv.url}", "--no-access-log"]
        cenv = {e["name"]: e["value"] for e in c["env"] if "value" in e} | {"MOA_SERVE_UPSTREAM": srv.url}
        log = open(tmp_path / "gateway.log", "w")
        proc = subprocess.Popen([*c["command"], *args], env=env | cenv, stdout=log, stderr=subprocess.STDOUT)
        try:
            url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(url + "/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            assert proc.poll() is None, (tmp_path / "gateway.log").read_text()[-3000:]
            model = next(a for a in args if a.startswith("--served-model-name=")).split("=", 1)[1]
            assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == model
            r = httpx.post(
                url + "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == fake.expected(3)
            assert httpx.get(url + "/ready").json()["backend"] == "sglang"
        finally:
            proc.terminate()
            assert proc.wait(timeout=30) == 0


# --- the training Job, and its head in the plugin -----------------------------------------------------------

ANSWER = {"role": "assistant", "content": "(the answer distill replaces with the target's)"}
CONVERSATIONS = ["Name three colors.", "What is 2 + 2?", "Say hello.", "Count to five.", "Name a fruit."]


def write_small_target(d: Path) -> Path:
    """A random 3-layer Llama with SmolLM2's tokenizer (what `moa-serve train` and the plugin read)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sglang_ext.models.loader import resolve_target

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (resolve_target("smollm2") / f).is_file():
            shutil.copy(resolve_target("smollm2") / f, d / f)
    return d


@pytest.fixture(scope="module")
def job_head(image, helm, tmp_path_factory):
    """The training Job's script, as the chart renders it, run in the image's venv on this CPU: 2 gloo ranks,
    the small target served by the embedded engine on loopback (the release's SGLang Service stand-in)."""
    from serving.config import EngineConfig
    from serving.engine import Engine
    from serving.gateway.app import create_app
    from serving.gateway.server import ServerThread, embedded_backend
    from sglang_ext.models import load_target

    python, env, _ = image
    cache = tmp_path_factory.mktemp("models")
    target = write_small_target(cache / "small-target")
    data = cache / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"c{i}", "conversations": [{"role": "user", "content": q}, ANSWER]}) + "\n"
            for i, q in enumerate(CONVERSATIONS)
        )
    )
    engine = Engine(load_target(str(target)), None, EngineConfig(kv_slots=4096))
    backend, telemetry = embedded_backend(engine, "small-target", "none")
    with ServerThread(create_app(backend, telemetry)) as srv:
        settings = {
            "training.enabled": "true",
            "modelCache.mountPath": str(cache),
            "modelCache.init.enabled": "false",
            "model.path": str(target),
            "training.baseUrl": srv.url,
            "training.data": str(data),
            "training.numConversations": "5",
            "training.maxNewTokens": "8",
            "training.concurrency": "2",
            "training.gpus": "2",
        }
        args = [x for k, v in settings.items() for x in ("--set", f"{k}={v}")]
        train_args = ["--max-steps=2", "--tokens-per-batch=256", "--max-len=64", "--draft-vocab-size=64", "--threads=1"]
        args += ["--set-json", f"training.trainArgs={json.dumps(train_args)}"]
        c = container(helm.render(*args), "Job", "-training", "training")
        assert c["command"][:2] == ["/bin/sh", "-ec"]
        job = {"command": c["command"], "env": env | {e["name"]: e["value"] for e in c["env"] if "value" in e}}

        def run():  # the Job's container: its command, its environment, in the image
            return subprocess.run(job["command"], env=job["env"], capture_output=True, text=True, timeout=600)

        # (a rescheduled pod runs the same script again: its two steps' --resume is checked where each is tested,
        # tests/entrypoints/test_distill_remote.py and test_train.py; here it would cost another two-rank run)
        first = run()
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
        out = cache / "drafters" / job["env"]["RUN_NAME"]
        head = out / "run" / "heads" / "moa-tli1"
        assert f"servable head: {head}" in first.stdout
        summary = json.loads((out / "run" / "summary.json").read_text())
    return {"head": head, "target": target, "out": out, "first": first, "summary": summary}


def test_the_training_job_runs_distill_and_two_ranks(job_head):
    out, summary = job_head["out"], job_head["summary"]
    records = [json.loads(line) for line in (out / "data" / "answers.jsonl").read_text().splitlines()]
    assert len(records) == len(CONVERSATIONS) and all(r["output_ids"] for r in records)
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert (out / "run" / "latest").is_file() and (job_head["head"] / "config.json").is_file()


@pytest.fixture(scope="module")
def sglang_side(image, job_head, helm, tmp_path_factory) -> dict:
    """One process of the image's python (sglang's imports take ~20 s here): the router's module with the
    chart's arguments, SGLang's plugin registration, the plugin's loader on the training Job's head."""
    python, env, _ = image
    router = container(helm.render("--set", "router.enabled=true"), "Deployment", "-router", "router")
    tmp = tmp_path_factory.mktemp("sglang-side")
    script = tmp / "sglang_side.py"
    script.write_text(SGLANG_SIDE)
    proc = subprocess.run(
        [python, str(script), str(job_head["head"]), str(job_head["target"]), json.dumps(router["args"])],
        env=env | {"TRITON_INTERPRET": "1"},
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"prefix": str(python.parents[1])}


def test_the_router_pod_module_takes_the_charts_arguments(sglang_side, helm):
    c = container(helm.render("--set", "router.enabled=true"), "Deployment", "-router", "router")
    assert c["command"] == ["python3", "-m", "sglang_router.launch_router"]
    assert sglang_side["router_module"] == "sglang_router.launch_router" and sglang_side["router_has_main"]
    assert sglang_side["router_policy"] == "cache_aware" and sglang_side["router_service_discovery"]


def test_the_plugin_registers_and_loads_the_jobs_head(sglang_side):
    """In the image's venv: SGLang's load_plugins() finds MOA through the installed entry point, the plugin's
    checks accept the Job's head for its target, and SGLang's MoA model consumes every weight of it."""
    result = sglang_side
    assert result["entry_point"] == "sglang_ext.sglang_plugin:register"
    assert result["plugin_file"].startswith(result["prefix"]), "the plugin must be the image's installed one"
    assert result["registered"] and result["tli"] == 1
    assert result["consumed"] == result["checkpoint_names"] and result["loaded"] == result["expected"]


SGLANG_SIDE = """
import json, os, sys
from importlib.metadata import entry_points

head, target = sys.argv[1], sys.argv[2]
import sglang_router.launch_router as router  # the router pod's `python3 -m sglang_router.launch_router`

router_args = router.parse_router_args(json.loads(sys.argv[3]))  # (a flag it does not know: SystemExit)

from sglang.srt.plugins import load_plugins

load_plugins()
from sglang.srt.speculative.spec_registry import get_spec

import sglang_ext.sglang_plugin as plugin
from sglang_ext.models.checkpoint import check_fits, read_config, read_weights
from sglang_ext.models.loader import LlamaConfig
from sglang_ext.sglang_plugin.algorithm import read_moa_checkpoint

cfg = read_moa_checkpoint(head)
check_fits(cfg, LlamaConfig.from_hf(read_config(target)), "--model-path")

for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29733", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
    os.environ.setdefault(k, v)
from sglang.srt.distributed import parallel_state
from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
from sglang.srt.server_args import ServerArgs

init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
reset_context()
publish(ServerArgs(model_path="dummy", tp_size=1, pp_size=1, device="cpu"), role="test", ranks=SpawnRanks(world_rank=0))
get_parallel().override_permanently(world_group=parallel_state._WORLD)
initialize_model_parallel(backend="gloo")

from transformers import AutoConfig
from sglang_ext.sglang_plugin.models.moa_draft import MoADraftModel, expected_loaded_names

model = MoADraftModel(AutoConfig.from_pretrained(head))
state = read_weights(head)
loaded = model.load_weights(state.items())
print(json.dumps({
    "router_module": router.__name__,
    "router_has_main": callable(getattr(router, "main", None)),
    "router_policy": router_args.policy,
    "router_service_discovery": bool(router_args.service_discovery),
    "entry_point": [e.value for e in entry_points(group="sglang.srt.plugins") if e.name == "moa_serve"][0],
    "plugin_file": plugin.__file__,
    "registered": get_spec("MOA") is not None,
    "tli": cfg.tli,
    "checkpoint_names": sorted(state),
    "consumed": sorted(model.loaded_weight_names),
    "loaded": sorted(loaded),
    "expected": sorted(expected_loaded_names(model)),
}))
"""
