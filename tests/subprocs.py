"""The environment of the CLI subprocesses the tests start: the CPU, N host devices, LLVM at -O0.

The tests' programs are small and run briefly, so compiling them is most of the suite's time, and
LLVM's optimisations are about half of that; XLA's own HLO passes still run at -O0.
"""

import os

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int = 1, fast_compile: bool = True) -> str:
    return f"--xla_force_host_platform_device_count={devices}" + (f" {FAST_COMPILE}" if fast_compile else "")


def cpu_env(devices: int = 1) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices))
