"""Builds mlxr's optional CPU kernels (mlxr/ops/cpu/*.c) at install time.

Everything else is in pyproject.toml. The extension is optional: where no C compiler (or no
OpenMP, or no -march=native) is at hand, the build retries with fewer flags and finally skips
it, so `pip install .` / `pip install -e .` still succeed and mlxr runs its torch paths
(mlxr.ops.cpu.native.available() says which). No prebuilt binary is ever fetched.
"""

from __future__ import annotations

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

BASE = ["-O3", "-std=gnu11"]
# tried in order: the first set the compiler accepts is used
FLAG_SETS = [BASE + ["-march=native", "-fopenmp"], BASE + ["-march=native", "-fopenmp-simd"],
             BASE + ["-fopenmp"], BASE]


class OptionalBuild(build_ext):
    """build_ext that retries each extension with fewer flags and never fails the install."""

    def build_extension(self, ext):
        for flags in FLAG_SETS:
            ext.extra_compile_args = flags
            ext.extra_link_args = ["-fopenmp"] if "-fopenmp" in flags else []
            try:
                super().build_extension(ext)
                return
            except Exception as e:  # noqa: BLE001 - any compiler failure: try the next flags
                self.warn(f"mlxr: building {ext.name} with {flags} failed: {e}")
        self.warn(f"mlxr: {ext.name} not built; the torch CPU paths will be used")

    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - no compiler at all: install without it
            self.warn(f"mlxr: CPU kernels not built ({e}); the torch CPU paths will be used")


setup(
    ext_modules=[Extension("mlxr.ops.cpu._kernels",
                           [f"mlxr/ops/cpu/{f}.c"
                            for f in ("kernels", "qmm", "i4mm", "i4deq", "attend", "layer", "gdn")],
                           depends=["mlxr/ops/cpu/kernels.h"], optional=True)],
    cmdclass={"build_ext": OptionalBuild},
)
