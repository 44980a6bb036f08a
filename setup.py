"""Build and install mooncake_ep_switch.

The native extension (csrc/) is plain C++17 + pybind11 with no torch linkage, split by domain:
csrc/dataplane/ (memfd regions, the one-sided dispatch/combine, packing kernels, value checks) receives raw
pointers and sizes from the Python layer and moves bytes; csrc/switch/ holds the TP<->EP switch copies and
signal waits; csrc/eplb/ the EPLB placement search and swap refinement, compute loops over arrays the Python
layer validated; csrc/common/ the shared number formats, region layout and backoff; csrc/module.cpp the
pybind11 bindings. Each domain declares its entry points in its own api.h. The PyTorch-collective transport lives
in mooncake_ep_switch/buffer/transport/collective.py; the top-level fallback/ folder, installed as the subpackage
mooncake_ep_switch.fallback, is its thin entry point (a re-export).
"""
import glob
import os
import re
import shutil
import subprocess

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

# The CUDA data plane (csrc/cuda/, module mooncake_ep_switch._cuda): nvcc objects (kernels and
# runtime calls) linked with the static CUDA runtime into a pybind11 module, so it needs no torch
# and no CUDA library at import time. Built whenever nvcc is found; a compile error fails the build.
CUDA_SOURCES = sorted(glob.glob("csrc/cuda/*.cu"))
# sm_80 (A100) and sm_90 (H100/H200) machine code, plus compute_90 PTX for newer GPUs.
CUDA_ARCH_FLAGS = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                   "-gencode=arch=compute_90,code=compute_90"]
# IEEE division and no fused multiply-add: the device computes the FP8 codes and the combine sums
# bit for bit as the CPU kernels do (common/numerics.h, docs/protocol.md).
NVCC_FLAGS = ["-std=c++17", "-O3", "-fmad=false", "-prec-div=true", "-Xcompiler", "-fPIC", "-Icsrc"]


def find_cuda_home(nvcc: str) -> str:
    """The CUDA toolkit folder of `nvcc` (it may be a wrapper script elsewhere on the PATH)."""
    real = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.exists(os.path.join(real, "include", "cuda_runtime.h")):
        return real
    # nvcc names its own folder in a dry run ("#$ _HERE_=<toolkit>/bin").
    dry = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull], capture_output=True,
                         text=True)
    found = re.search(r"^#\$ _HERE_=(\S+)", dry.stdout + dry.stderr, re.M)
    if found and os.path.exists(os.path.join(found.group(1), "..", "include", "cuda_runtime.h")):
        return os.path.normpath(os.path.join(found.group(1), ".."))
    raise RuntimeError(f"nvcc at {nvcc}: cannot find its CUDA toolkit (include/cuda_runtime.h)")


class BuildWithCuda(build_ext):
    """build_ext that compiles the CUDA sources with nvcc before linking the `_cuda` module."""

    def build_extension(self, ext):
        if ext.name.endswith("._cuda"):
            nvcc = shutil.which("nvcc")
            home = find_cuda_home(nvcc)
            objects = []
            os.makedirs(self.build_temp, exist_ok=True)
            for source in CUDA_SOURCES:
                obj = os.path.join(self.build_temp, os.path.basename(source) + ".o")
                command = [nvcc, *NVCC_FLAGS, *CUDA_ARCH_FLAGS, "-c", source, "-o", obj]
                print(" ".join(command))
                subprocess.run(command, check=True)  # a compile error fails the build
                objects.append(obj)
            ext.extra_objects = objects
            ext.library_dirs = [d for d in (os.path.join(home, "lib64"), os.path.join(home, "lib"))
                                if os.path.isdir(d)]
        super().build_extension(ext)


native = Pybind11Extension(
    "mooncake_ep_switch._native",
    sorted(path for path in glob.glob("csrc/**/*.cpp", recursive=True) if not path.startswith("csrc/cuda/")),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-strict-aliasing"],
    libraries=["rt"],
)

# The same kernels (csrc/cuda/ep_kernels.cuh) built by the host compiler on a block/warp emulator,
# on every machine: CI runs the device-kernel logic without a GPU (tests/test_cuda_sim.py). Every typed
# access is checked for its alignment and traps (SIGILL) when it is off, as the GPU faults on one
# (cudaErrorMisalignedAddress) where x86 would let it pass: the check needs no sanitizer runtime.
cuda_sim = Pybind11Extension(
    "mooncake_ep_switch._cuda_sim",
    ["csrc/cuda/sim.cpp", "csrc/cuda/sim_runtime.cpp"],
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O2", "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-unknown-pragmas",
                        "-fsanitize=alignment", "-fsanitize-undefined-trap-on-error"],
    depends=glob.glob("csrc/cuda/*.h") + glob.glob("csrc/cuda/*.cuh") + ["csrc/common/numerics.h"],
)

extensions = [native, cuda_sim]
if shutil.which("nvcc"):
    extensions.append(Pybind11Extension(
        "mooncake_ep_switch._cuda",
        ["csrc/cuda/module.cpp"],
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=["-O3"],
        libraries=["cudart_static", "rt", "dl", "pthread"],
        depends=CUDA_SOURCES + glob.glob("csrc/cuda/*.h") + glob.glob("csrc/cuda/*.cuh") + ["csrc/common/numerics.h"],
    ))
else:
    print("mooncake_ep_switch: nvcc not found on the PATH: the CUDA data plane (mooncake_ep_switch._cuda) is "
          "not built; the 'cuda' transport will be unavailable")

def read_version() -> str:
    """`VERSION` from mooncake_ep_switch/version.py (read, not imported: the package needs torch)."""
    with open(os.path.join("mooncake_ep_switch", "version.py"), encoding="utf-8") as handle:
        return re.search(r'^VERSION = "([^"]+)"', handle.read(), re.M).group(1)


setup(
    name="mooncake_ep_switch",
    version=read_version(),
    description="Fault-tolerant MoE expert-parallel dispatch/combine with runtime TP<->EP switching and EPLB",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=["Programming Language :: Python :: 3",
                 "Operating System :: POSIX :: Linux", "Typing :: Typed"],
    python_requires=">=3.10",
    packages=[
        "mooncake_ep_switch",
        "mooncake_ep_switch.apps",
        "mooncake_ep_switch.launcher",
        "mooncake_ep_switch.bench",
        "mooncake_ep_switch.buffer",
        "mooncake_ep_switch.buffer.membership",
        "mooncake_ep_switch.buffer.transport",
        "mooncake_ep_switch.elastic_buffer",
        "mooncake_ep_switch.switch",
        "mooncake_ep_switch.switch.planning",
        "mooncake_ep_switch.eplb",
        "mooncake_ep_switch.eplb.policy",
        "mooncake_ep_switch.reference",
        "mooncake_ep_switch.fallback",
        "mooncake_ep_switch.models",
        "mooncake_ep_switch.store",
    ],
    package_dir={"mooncake_ep_switch.fallback": "fallback"},
    package_data={"mooncake_ep_switch": ["py.typed"]},
    ext_modules=extensions,
    cmdclass={"build_ext": BuildWithCuda},
    # torch is pinned by the install script *before* this package is installed (an open range
    # with no torch present would pull a multi-GB CUDA build); this range only checks it. The lower bounds are
    # what is tested: torch 2.13 (CPU, CI) and 2.11 (+cu130, the GPU runs); numpy 2.x.
    install_requires=["torch>=2.11", "numpy>=2.0"],
    # Every extra is described in the README ("Extras").
    extras_require={
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist", "hypothesis"],
        "mooncake": ["mooncake-transfer-engine-non-cuda>=0.3.13"],
        "mooncake-cuda": ["mooncake-transfer-engine>=0.3.13"],
        "nccl": ["nvidia-nccl-cu12"],
        "plot": ["matplotlib"],
        # the etcd store (mooncake_ep_switch.store): etcd3gw speaks etcd v3's JSON gateway, pure Python
        "etcd": ["etcd3gw>=2.4"],
        # transformers 5 fuses a MoE layer's experts into [E, 2I, H] / [E, H, I] tensors, the
        # layout mooncake_ep_switch.models serves; 5.x does not change torch.
        "models": ["transformers>=5.0,<6"],
    },
    entry_points={"console_scripts": ["mooncake-ep=mooncake_ep_switch.apps.cli:main"]},
)
