"""Scale-out pieces checkable on a CPU host: the AOT fit check and the TPU pod scripts."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _aot(*args):
    return subprocess.run([sys.executable, "-m", "sem_jax.aot", *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_aot_check_small_topology():
    pytest.importorskip("libtpu", reason="jax[tpu] (libtpu) not installed: the compile-only TPU check is skipped")
    ok = _aot("--config", "configs/demo_cpu.py", "--topology", "v4:2x2x1", "--config.rl.beta=0.04",
              "--config.model.eval_dtype=bfloat16")
    assert ok.returncode == 0, ok.stderr[-3000:]
    for step in ("grpo update", "reference logprobs", "sampler prefill", "sampler decode loop",
                 "eval (bfloat16) prefill", "eval (bfloat16) decode loop"):
        assert f"| {step} |" in ok.stdout
    assert ok.stdout.rstrip().endswith("fits")
    # 8 layers of width 8192, replicated (no FSDP): ~34 GB of f32 weights per device.
    big = _aot("--config", "configs/demo_cpu.py", "--topology", "v4:2x2x1", "--config.mesh.fsdp=1",
               "--config.mesh.data=-1", "--config.model.init.hidden_size=8192",
               "--config.model.init.intermediate_size=32768", "--config.model.init.num_layers=8",
               "--config.model.init.num_heads=64", "--config.model.init.num_kv_heads=8")
    assert big.returncode == 1, big.stderr[-3000:]
    assert "DOES NOT FIT" in big.stderr and "| NO |" in big.stdout


def test_aot_without_tpu_topology_names_the_cause():
    try:
        import libtpu  # noqa: F401
        pytest.skip("libtpu is installed: the missing-libtpu message cannot be shown")
    except ImportError:
        pass
    bad = _aot("--config", "configs/demo_cpu.py", "--topology", "v4:2x2x1")
    assert bad.returncode != 0 and "jax[tpu]" in bad.stderr


def _pod(*args, **env):
    return subprocess.run(["bash", "tpu/pod.sh", "--dry-run", *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env=dict(os.environ, **env))


def test_tpu_pod_script_dry_run():
    create = _pod("create", TPU_NAME="exp1", ZONE="us-central2-b", ACCELERATOR="v4-64", PROJECT="proj")
    assert create.returncode == 0, create.stderr
    assert create.stdout.split() == ("gcloud compute tpus queued-resources create exp1-qr --node-id exp1 --zone "
                                     "us-central2-b --project proj --accelerator-type v4-64 --runtime-version "
                                     "tpu-ubuntu2204-base --spot").split()
    assert "--reserved" in _pod("create", CAPACITY="reserved").stdout
    assert _pod("create", CAPACITY="cheap").returncode == 2
    setup = _pod("setup", TPU_NAME="exp1").stdout.splitlines()
    assert setup[0].startswith("git -C ") and "archive" in setup[0]
    assert "tpu-vm scp" in setup[1] and "--worker=all" in setup[1]
    assert "tpu-vm ssh exp1" in setup[2] and "pip\\ install" in setup[2] and "\\'.\\[tpu\\]\\'" in setup[2]
    launch = _pod("launch", "--config", "configs/tpu_v4.py", "--config.rl.beta=0.0").stdout
    assert "--worker=all" in launch and "sem_jax.train\\ --config\\ configs/tpu_v4.py\\ --config.rl.beta=0.0" in launch
    evaluate = _pod("evaluate", "--config", "configs/tpu_v4.py", "--checkpoint", "RUN/ckpt").stdout
    assert "--worker=all" in evaluate and "sem_jax.evaluate\\ --config\\ configs/tpu_v4.py\\ --checkpoint\\ RUN/ckpt" in evaluate
    stop = _pod("stop").stdout
    assert "--worker=all" in stop and "libtpu_lockfile" in stop and "pkill" in stop
    assert "--worker=2" in _pod("logs", "2").stdout
    assert _pod("delete").stdout.split()[:5] == ["gcloud", "compute", "tpus", "queued-resources", "delete"]
    mount = _pod("mount", BUCKET="my-runs", MOUNT="/mnt/r").stdout
    assert "--worker=all" in mount and "gcsfuse\\ --implicit-dirs\\ my-runs\\ /mnt/r" in mount
    assert _pod("mount").returncode == 2  # no BUCKET
    assert _pod("launch").returncode == 2
    assert _pod("nonsense").returncode == 2
