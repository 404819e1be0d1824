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


def free_address() -> str:
    """localhost:PORT with a port free now: a coordinator for processes started next."""
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return f"localhost:{s.getsockname()[1]}"


def run_together(cmds: list[tuple[list[str], int]], cwd: str, timeout: float = 600) -> list[str]:
    """Start every (argv, host devices) at once (processes of one runtime wait for each other),
    wait for all, and return their outputs; each must exit 0 (a failure shows its output's tail)."""
    import subprocess
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                              env=cpu_env(devices)) for argv, devices in cmds]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs
