"""Builds dtr and its C++ core (dtr._C) against the installed torch.

Install without build isolation so the extension is compiled against the torch already in
the environment (pip would otherwise fetch another torch into a temporary one):

    pip install --no-build-isolation -e .

DEBUG=1 builds the core with -O0 -g. DTR_NO_EXTENSION=1 skips it (dtr then uses its
pure-Python core and says so once).
"""

import glob
import os

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as exc:  # pragma: no cover - explained to the user
    raise SystemExit(
        "dtr: building the C++ core needs torch installed first (pip install torch==2.13.0), "
        f"then `pip install --no-build-isolation -e .` ({exc})"
    ) from exc

debug = os.environ.get("DEBUG", "0") == "1"
flags = ["-O0", "-g"] if debug else ["-O2"]
flags += ["-std=c++17", f'-DDTR_TORCH_VERSION="{torch.__version__}"']

ext_modules = []
if os.environ.get("DTR_NO_EXTENSION", "0") != "1":
    ext_modules.append(
        CppExtension(
            name="dtr._C",
            sources=sorted(
                path
                for path in glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True)
                if not path.startswith(os.path.join("csrc", "emulated", ""))
            ),
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args=flags,
        )
    )
    # The emulated accelerator of the tests (tests/emulated_device.py); `import dtr` never
    # loads it.
    ext_modules.append(
        CppExtension(
            name="dtr._emulated",
            sources=sorted(glob.glob(os.path.join("csrc", "emulated", "*.cpp"))),
            include_dirs=[os.path.abspath(os.path.join("csrc", "emulated"))],
            extra_compile_args=flags,
        )
    )

setup(
    name="dtr",
    version="0.1.0",
    description="Dynamic Tensor Rematerialization for PyTorch: train under a memory budget",
    packages=find_packages(include=["dtr", "dtr.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.13", "numpy"],
    extras_require={
        "test": [
            "pytest",
            "hypothesis",
            "expecttest",  # torch.testing._internal (OpInfo) imports it
            "scipy",
            "matplotlib",
            "tqdm",
            "transformers",
            "accelerate",
            "nbclient",
            "nbformat",
            "ipykernel",
        ]
    },
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
