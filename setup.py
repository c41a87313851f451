"""Builds the native extension `zkernel._native` (pybind11, no libtorch link).

Everything else about the distribution lives in pyproject.toml.
"""

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# The sources compile side by side, one per core (ZKERNEL_BUILD_JOBS overrides): the install is
# part of every fresh clone's test run.
ParallelCompile("ZKERNEL_BUILD_JOBS").install()

native = Pybind11Extension(
    "zkernel._native",
    sources=sorted(
        [
            "native/aio.cpp",
            "native/bandwidth.cpp",
            "native/bindings.cpp",
            "native/cpu_adam.cpp",
            "native/crc32c.cpp",
            "native/ring_watch.cpp",
            "native/split_master.cpp",
            "native/thread_pool.cpp",
        ]
    ),
    include_dirs=["native"],
    cxx_std=17,
    # Baseline ISA only: the AVX2/AVX-512 paths carry their own target attributes
    # and are chosen at run time. No FMA contraction, so every path rounds the same.
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-Wno-maybe-uninitialized"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
