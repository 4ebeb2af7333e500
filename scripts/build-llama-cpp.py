"""Installs llama-cpp-python (the `llama.cpp` peer of `moa-serve bench`) built for this CPU, and makes sure it runs.

    .venv/bin/python scripts/build-llama-cpp.py            # what `make bench-peers` runs
    .venv/bin/python scripts/build-llama-cpp.py --check    # only say which build is installed and whether it decodes

Builds, in order, until one decodes the shipped GGUF in a subprocess (a crashed build is a dead subprocess,
not a dead bench):
  native    GGML_NATIVE=ON: every feature of this CPU (AVX-512 VNNI/BF16 where it has them), what a user's
            `pip install llama-cpp-python` gets
  portable  the x86 features set explicitly (AVX2/FMA/F16C, AVX-512 F/BW/VL/VNNI only where this CPU has
            them, AMX off): for CPUs or VMs where the native build crashes (one did on an earlier CI VM)
  avx2      AVX2/FMA/F16C only
Each wheel is built once into build/llama-cpp/<flavour>/ (~20 minutes on one core; CMAKE_BUILD_PARALLEL_LEVEL)
and reused; the installed flavour is written to build/llama-cpp/installed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

VERSION = "0.3.36"
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "llama-cpp"
AMX_OFF = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
BASE = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]

# decodes 8 greedy tokens of the shipped GGUF; prints the build's features (llama_print_system_info)
SMOKE = """
import sys
from llama_cpp import Llama, llama_print_system_info
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=1, n_threads_batch=1, verbose=False)
out = [t for _, t in zip(range(8), llm.generate(llm.tokenize(b"The capital of France is"), temp=0.0))]
assert len(out) == 8, out
print(llama_print_system_info().decode())
"""


def cpu_flags() -> set[str]:
    try:
        return set(next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "").split())
    except OSError:
        return set()


def flavours() -> dict[str, list[str]]:
    flags = cpu_flags()
    portable = [*BASE, *AMX_OFF]
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        portable.append("-DGGML_AVX512=ON")
        if "avx512_vnni" in flags:
            portable.append("-DGGML_AVX512_VNNI=ON")
        if "avx512_bf16" in flags:
            portable.append("-DGGML_AVX512_BF16=ON")
    return {"native": ["-DGGML_NATIVE=ON"], "portable": portable, "avx2": [*BASE, *AMX_OFF]}


def gguf() -> str:
    sys.path.insert(0, str(ROOT))
    from sglang_ext.models.loader import smollm2_gguf_path

    return str(smollm2_gguf_path())


def smoke(model: str) -> tuple[bool, str]:
    """Whether the installed build decodes (in a subprocess: a build that crashes kills only it)."""
    try:
        r = subprocess.run([sys.executable, "-c", SMOKE, model], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False, "timed out"
    if r.returncode == 0:
        return True, r.stdout.strip()
    why = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
    return False, f"{why}: {(r.stderr or r.stdout).strip().splitlines()[-1:] or ''}"


def wheel(flavour: str, cmake_args: list[str]) -> Path:
    """The flavour's wheel, built once (no pip cache: a cached wheel of another flavour would be reused)."""
    where = OUT / flavour
    found = sorted(where.glob(f"llama_cpp_python-{VERSION}-*.whl"))
    if found:
        return found[0]
    where.mkdir(parents=True, exist_ok=True)
    print(f"[build-llama-cpp] building {flavour}: CMAKE_ARGS={' '.join(cmake_args)}", flush=True)
    env = os.environ | {"CMAKE_ARGS": " ".join(cmake_args)}
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", "1")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-cache-dir", "--no-deps", "-w", str(where)]
    subprocess.run([*cmd, f"llama-cpp-python=={VERSION}"], env=env, check=True)
    return sorted(where.glob(f"llama_cpp_python-{VERSION}-*.whl"))[0]


def install(path: Path) -> None:
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--force-reinstall", "--no-deps", str(path)], check=True)
    subprocess.run([*pip, str(path)], check=True)  # its dependencies (numpy, diskcache, jinja2, ...)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="report the installed build and whether it decodes")
    args = ap.parse_args()
    model = gguf()
    marker = OUT / "installed"
    if args.check:
        ok, info = smoke(model)
        print(
            f"llama-cpp-python: {marker.read_text().strip() if marker.exists() else 'not built here'}; "
            f"{'decodes' if ok else 'fails'}: {info}"
        )
        return 0 if ok else 1
    for flavour, cmake_args in flavours().items():
        install(wheel(flavour, cmake_args))
        ok, info = smoke(model)
        if ok:
            OUT.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{flavour} ({' '.join(cmake_args)})\n")
            print(f"[build-llama-cpp] {flavour} build installed; it decodes: {info}")
            return 0
        print(f"[build-llama-cpp] the {flavour} build does not run here ({info}); trying the next", flush=True)
    print("[build-llama-cpp] no build of llama-cpp-python runs on this machine", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
