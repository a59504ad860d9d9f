"""Builds appliance.kernels._kernels, every compiled kernel, from kernels/ (C + Cython) and its thread pool.

Flags follow the *target* platform (sysconfig.get_platform() honours
_PYTHON_HOST_PLATFORM, so cross builds for aarch64 work):
  x86_64  : -mavx2 -mfma -mf16c            (APPLIANCE_MARCH overrides, e.g. -march=native)
  aarch64 : -march=armv8.2-a+dotprod+fp16  (APPLIANCE_MARCH=-mcpu=native on a board; a native
            build on a CPU without dotprod falls back to -march=armv8-a, the plain NEON path)
  other   : portable C only
APPLIANCE_PORTABLE=1 builds without any SIMD path.
NUMPY_INCLUDE / CYTHON_INCLUDE_PATH point at the target's headers in cross builds.
"""
import os
import platform
import sysconfig

from setuptools import Extension, find_packages, setup
from Cython.Build import cythonize


def native_aarch64_has_dotprod() -> bool:
    """On an aarch64 build host that is also the target: does this CPU have the dot product?"""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("Features") and " asimddp" in line for line in f)
    except OSError:
        return True


target = sysconfig.get_platform()
march = os.environ.get("APPLIANCE_MARCH", "").split()
native = platform.machine() in ("aarch64", "arm64") and target.endswith(("aarch64", "arm64"))
if os.environ.get("APPLIANCE_PORTABLE") == "1":
    arch_flags = []
elif target.endswith(("aarch64", "arm64")):
    # A native build on a CPU without dotprod gets the plain NEON path instead of a build
    # its own CPU would refuse; cross builds target the boards (A76/A55: dotprod).
    if march:
        arch_flags = march
    elif native and not native_aarch64_has_dotprod():
        arch_flags = ["-march=armv8-a"]
    else:
        arch_flags = ["-march=armv8.2-a+dotprod+fp16"]
elif target.endswith(("x86_64", "amd64")):
    arch_flags = march or ["-mavx2", "-mfma", "-mf16c"]
else:
    arch_flags = []

numpy_include = os.environ.get("NUMPY_INCLUDE") or __import__("numpy").get_include()
cython_include = [p for p in os.environ.get("CYTHON_INCLUDE_PATH", "").split(os.pathsep) if p]

sources = [
    "kernels/kernels.pyx",
    "kernels/portable.c",
    "kernels/x86/avx2.c",
    "kernels/x86/avx2_attention.c",
    "kernels/x86/avx2_strips.c",
    "kernels/x86/avx_vnni.c",
    "kernels/x86/avx512_vnni.c",
    "kernels/x86/avx512_attention.c",
    "kernels/arm/neon.c",
    "kernels/arm/neon_attention.c",
    "kernels/kv_store.c",
    "kernels/sparse_select.c",
    "kernels/strips.c",
    "kernels/dispatch.c",
    "kernels/pool.c",
]

extension = Extension(
    "appliance.kernels._kernels",
    sources,
    include_dirs=["kernels", numpy_include],
    extra_compile_args=["-O3", "-pthread", "-ffp-contract=off", "-std=gnu11"] + arch_flags,
    extra_link_args=["-pthread"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
)

# web/ (dashboard templates and static files) sits beside the package in the source tree and
# ships inside it as appliance/web, where appliance.server looks for it once installed.
DATA_PACKAGES = ["appliance.demo_model", "appliance.web", "appliance.web.templates", "appliance.web.static"]

setup(
    # The data directories are packages too (demo model, dashboard files): named here, setuptools
    # ships them without a "Package would be ignored" warning per directory.
    packages=find_packages(include=["appliance", "appliance.*"]) + DATA_PACKAGES,
    package_dir={"appliance.web": "web"},
    package_data={"appliance.demo_model": ["*.json", "*.safetensors", "*.txt"],
                  "appliance.web.templates": ["*"], "appliance.web.static": ["*"]},
    ext_modules=cythonize([extension], include_path=cython_include, language_level=3,
                          compiler_directives={"boundscheck": False, "wraparound": False}),
)
