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

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

native = Pybind11Extension(
    "mooncake_ep_switch._native",
    sorted(glob.glob("csrc/**/*.cpp", recursive=True)),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-strict-aliasing"],
    libraries=["rt"],
)

setup(
    name="mooncake_ep_switch",
    version="0.1.0",
    description="Fault-tolerant MoE expert-parallel dispatch/combine with runtime TP<->EP switching and EPLB",
    python_requires=">=3.10",
    packages=[
        "mooncake_ep_switch",
        "mooncake_ep_switch.bench",
        "mooncake_ep_switch.buffer",
        "mooncake_ep_switch.buffer.transport",
        "mooncake_ep_switch.switch",
        "mooncake_ep_switch.switch.planning",
        "mooncake_ep_switch.eplb",
        "mooncake_ep_switch.eplb.policy",
        "mooncake_ep_switch.reference",
        "mooncake_ep_switch.fallback",
        "mooncake_ep_switch.models",
    ],
    package_dir={"mooncake_ep_switch.fallback": "fallback"},
    ext_modules=[native],
    cmdclass={"build_ext": build_ext},
    # torch is pinned by the install script *before* this package is installed (an open range
    # with no torch present would pull a multi-GB CUDA build); this range only checks it.
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout", "hypothesis"],
        "mooncake": ["mooncake-transfer-engine-non-cuda"],
        "mooncake-cuda": ["mooncake-transfer-engine"],
        "nccl": ["nvidia-nccl-cu12"],
        "plot": ["matplotlib"],
        # transformers 5 fuses a MoE layer's experts into [E, 2I, H] / [E, H, I] tensors, the
        # layout mooncake_ep_switch.models serves; 5.x does not change torch.
        "models": ["transformers>=5.0,<6"],
    },
    entry_points={"console_scripts": ["mooncake-ep=mooncake_ep_switch.cli:main"]},
)
