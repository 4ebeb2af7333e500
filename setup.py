"""Builds the optional CPU kernels (sglang_ext/kernels/cpu_linear.cpp, cpu_attention.cpp, cpu_layer_ops.cpp, cpu_q8.cpp)
next to the Python sources, and puts the shipped drafters (drafters/) into the wheel.

Everything else is declared in pyproject.toml. The kernel needs x86-64 (AVX2 + FMA) and torch's
headers at build time (`pip install --no-build-isolation -e .` after torch); where either is
missing, or MOA_SERVE_CPU_KERNEL=0 (the GPU image, which never runs it), the package installs
without it and the model falls back to torch's matmul.

A wheel carries drafters/ as sglang_ext/drafters/packaged/ (sglang_ext/drafters/shipped.py looks there
first, then in the source tree's drafters/): an installed package serves with the shipped drafters.
"""

import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

SHIPPED_SRC = Path(__file__).resolve().parent / "drafters"
SHIPPED_PKG = ("sglang_ext", "drafters", "packaged")  # where a wheel holds them (shipped.py: PACKAGED_DIR)


class BuildWithDrafters(build_py):
    """build_py, then drafters/ copied into the build tree (an editable install reads the source tree's)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        if not SHIPPED_SRC.is_dir():  # a wheel without them would serve without its drafters: refuse
            raise SystemExit(f"setup.py: {SHIPPED_SRC} is missing (the shipped drafters go into the wheel)")
        dest = Path(self.build_lib, *SHIPPED_PKG)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(SHIPPED_SRC, dest)


def cpu_kernel_extensions() -> list[Extension]:
    if os.environ.get("MOA_SERVE_CPU_KERNEL", "1") == "0":
        print("setup.py: MOA_SERVE_CPU_KERNEL=0; building without the CPU kernel", file=sys.stderr)
        return []
    if platform.machine() not in ("x86_64", "AMD64") or sys.platform != "linux":
        return []
    try:
        from torch.utils.cpp_extension import include_paths, library_paths
    except ImportError:
        print("setup.py: torch not importable at build time; building without the CPU kernel", file=sys.stderr)
        return []
    libs = library_paths()
    return [
        Extension(
            "sglang_ext.kernels._cpu_linear",
            [
                "sglang_ext/kernels/cpu_linear.cpp",
                "sglang_ext/kernels/cpu_attention.cpp",
                "sglang_ext/kernels/cpu_layer_ops.cpp",
                "sglang_ext/kernels/cpu_q8.cpp",
            ],
            depends=[
                "sglang_ext/kernels/avx2_math.h",
                "sglang_ext/kernels/attention_rows.h",
                "sglang_ext/kernels/layer_rows.h",
            ],
            include_dirs=include_paths(),
            library_dirs=libs,
            runtime_library_dirs=libs,
            libraries=["c10", "torch_cpu"],
            language="c++",
            optional=True,  # a failed compile leaves the torch fallback, never a failed install
            # NOTE: -fopenmp makes at::parallel_for use torch's OpenMP pool (without it the loop runs on one thread)
            extra_compile_args=[
                "-O3",
                "-std=c++20",
                "-mavx2",
                "-mfma",
                "-mf16c",
                "-fopenmp",
                "-D_GLIBCXX_USE_CXX11_ABI=1",
            ],
            extra_link_args=["-fopenmp"],
        )
    ]


if __name__ == "__main__":  # setuptools runs this file as __main__; scripts/kernel-ab.py imports the extension
    setup(ext_modules=cpu_kernel_extensions(), cmdclass={"build_py": BuildWithDrafters})
