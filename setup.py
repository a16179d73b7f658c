"""Package build: pyproject.toml has the metadata; this adds the CPU kernels of the building
machine's instruction-set level to the package (layers/cpu_kernels.py build_prebuilt) where torch
is importable in the build (`pip install --no-build-isolation .`, `pip wheel --no-build-isolation
.`). Elsewhere, and for editable installs (`make setup` runs `tokenmill build-kernels` instead),
the kernels compile at first use."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        try:
            import torch  # noqa: F401
        except ImportError:
            print("tokenmill: torch is not importable in this build; the CPU kernels compile at first use")
            return
        from tokenmill.layers import cpu_kernels

        try:
            path = cpu_kernels.build_prebuilt(folder=Path(self.build_lib) / "tokenmill" / "_kernels")
            print(f"tokenmill: CPU kernels built into the package: {path.name}")
        except RuntimeError as e:
            print(f"tokenmill: warning: {e}; the kernels compile at first use")


class WithKernels(Distribution):
    """A wheel holding a compiled module is tagged for its Python and platform, not py3-none-any."""

    def has_ext_modules(self):
        return True


TORCH_IN_BUILD = importlib.util.find_spec("torch") is not None
setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=WithKernels if TORCH_IN_BUILD else Distribution)
