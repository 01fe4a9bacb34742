"""rgpu's build for pip: `pip install .` and `pip wheel .` run the CMake project (the same one
`make` drives) against the torch installed in the Python that runs pip, and put rgpu._C,
rgpu-opserver, its Inductor worker and rgpu-trace-dump into the package.

The compiled parts link libtorch, so they must be built against the very torch they will run
with: the wheel requires that torch release, and its libraries find torch's through RPATHs
relative to the installed package. pip's default isolated build hides the environment's
packages; torch is then found through this interpreter's own site-packages, never downloaded
again, and `--no-build-isolation` works the same (see the README).

An editable install (`make` does `pip install -e .` after building) builds nothing here.
"""

import functools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def find_torch():
    """torch's package folder and release, without importing it."""
    places = [Path(p) for p in sys.path if p]
    places += [Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")]
    for place in places:
        if (place / "torch" / "lib" / "libtorch_cpu.so").is_file():
            text = (place / "torch" / "version.py").read_text()
            version = re.search(r"^__version__\s*=\s*['\"]([^'\"+]+)", text, re.M).group(1)
            return place / "torch", version
    sys.exit(f"rgpu's build needs torch installed in the Python that runs it ({sys.executable}): "
             "install torch first (`pip install torch`), then rgpu")


def tool(name, hint):
    found = shutil.which(name)
    if not found:
        sys.exit(f"rgpu's build needs `{name}`: {hint}")
    return found


class BuildWithCMake(build_py):
    """Copies the Python sources, then builds the compiled parts straight into the copy."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # `make` built them into python/rgpu already
        torch_dir, release = find_torch()
        cmake = tool("cmake", "install it (`apt-get install cmake`, or `pip install cmake`)")
        tag = f"{sys.implementation.cache_tag}-torch{release}"
        build = ROOT / "build" / f"pip-{tag}"
        package = Path(self.build_lib).resolve() / "rgpu"
        configure = [
            cmake, "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
            "-DRGPU_BUILD_TESTS=OFF", "-DRGPU_RELOCATABLE=ON", f"-DRGPU_PYTHON_DIR={package}",
            # torch's headers and libraries straight from its folder: TorchConfig.cmake would ask
            # a CUDA build of torch for a CUDA toolkit, which rgpu does not use.
            "-DRGPU_TORCH_FROM_PYTHON=ON", f"-DRGPU_TORCH_PACKAGE_DIR={torch_dir}",
            f"-DPython3_EXECUTABLE={sys.executable}",
        ]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        env = dict(os.environ)
        if shutil.which("ccache"):
            configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
            env.setdefault("CCACHE_BASEDIR", str(ROOT))
        # A folder configured with another generator starts over; one configured for another
        # package location (`pip wheel` after `pip install`) is configured again: it keeps
        # its objects and only links into the new place.
        cache = build / "CMakeCache.txt"
        generator = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
        if cache.exists() and f"CMAKE_GENERATOR:INTERNAL={generator}\n" not in cache.read_text():
            shutil.rmtree(build)
        print(f"rgpu: building the native parts against torch {release} in {build}", flush=True)
        subprocess.run(configure, check=True, env=env)
        subprocess.run([cmake, "--build", str(build)], check=True, env=env)


class NativeDistribution(Distribution):
    """The wheel holds compiled code: tag it for this platform and Python."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithCMake}, distclass=NativeDistribution,
      install_requires=[f"torch=={find_torch()[1]}"])
