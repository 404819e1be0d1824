"""Checkpoints: params alone restore; an interrupted write never replaces the last good one."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sem_jax.checkpoint import CheckpointMismatch, Checkpointer
from subprocs import cpu_env


def _tree(seed):
    k = jax.random.key(seed)
    return {"w": jax.random.normal(k, (64, 32)), "b": jnp.arange(5.0) + seed}


def test_params_alone_and_leftover_partial_write(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(1, _tree(1), {"mu": _tree(10)}, {"step": 1})
    ckpt.close()
    # A write that died half way leaves orbax's temporary directory behind.
    partial = tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-1234" / "params"
    partial.mkdir(parents=True)
    (partial / "junk").write_bytes(b"\0" * 100)
    again = Checkpointer(str(tmp_path / "ckpt"))
    assert again.latest_step() == 1
    params, step = again.restore_params(None, _tree(0))
    assert step == 1
    jax.tree.map(np.testing.assert_array_equal, params, _tree(1))
    p, o, meta = again.restore(1, _tree(0), {"mu": _tree(0)})
    assert meta == {"step": 1}
    jax.tree.map(np.testing.assert_array_equal, o, {"mu": _tree(10)})


def test_killed_during_a_save_keeps_the_previous_step(tmp_path):
    """SIGKILL while step 2 (a large array) is being written: step 1 stays the latest, intact."""
    script = textwrap.dedent(f"""
        import os, sys, threading, time
        sys.path.insert(0, {os.getcwd()!r})
        import jax.numpy as jnp
        from sem_jax.checkpoint import CheckpointMismatch, Checkpointer
        ckpt = Checkpointer({str(tmp_path / 'ckpt')!r})
        ckpt.save(1, {{"w": jnp.ones((8, 8))}}, {{"mu": jnp.zeros(3)}}, {{"step": 1}})
        ckpt.wait()
        print("saved 1", flush=True)
        ckpt.save(2, {{"w": jnp.ones((4096, 8192))}}, {{"mu": jnp.zeros(3)}}, {{"step": 2}})
        print("saving 2", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=cpu_env())
    for line in proc.stdout:
        if line.startswith("saving 2"):
            proc.send_signal(signal.SIGKILL)  # async save of step 2 may be anywhere
            break
    proc.wait(timeout=120)
    assert proc.returncode == -9
    names = os.listdir(tmp_path / "ckpt")
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    if ckpt.latest_step() == 2:
        pytest.skip("the 128 MB write of step 2 finished before SIGKILL landed: nothing was interrupted")
    assert any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names  # really cut mid-write
    assert ckpt.latest_step() == 1
    params, _ = ckpt.restore_params(None, {"w": jnp.zeros((8, 8))})
    np.testing.assert_array_equal(np.asarray(params["w"]), np.ones((8, 8)))


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_newest_step_is_set_aside_and_the_one_before_restores(tmp_path, capsys, damage):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    for step in (1, 2, 3):
        ckpt.save(step, _tree(step), {"mu": _tree(10 + step)}, {"step": step})
    ckpt.close()
    files = sorted(p for p in (tmp_path / "ckpt" / "3" / "params").rglob("*") if p.is_file() and p.stat().st_size > 64)
    assert files
    for f in files:  # every data file of step 3's params: a disk that filled up, a copy cut short
        if damage == "truncate":
            f.write_bytes(f.read_bytes()[:16])
        else:
            f.unlink()
    again = Checkpointer(str(tmp_path / "ckpt"))
    step, params, opt, meta = again.restore_newest(_tree(0), {"mu": _tree(0)})
    assert (step, meta) == (2, {"step": 2})
    jax.tree.map(np.testing.assert_array_equal, params, _tree(2))
    jax.tree.map(np.testing.assert_array_equal, opt, {"mu": _tree(12)})
    assert "checkpoint step 3 does not restore" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2", "3.unreadable"] and again.latest_step() == 2
    again.save(3, _tree(30), {"mu": _tree(40)}, {"step": 3})  # the run goes on from step 2
    again.close()
    assert Checkpointer(str(tmp_path / "ckpt")).restore_params(None, _tree(0))[1] == 3


def test_a_full_disk_refuses_the_save_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    import shutil as real_shutil
    from collections import namedtuple

    import sem_jax.checkpoint as mod
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    ckpt.save(1, _tree(1), {"mu": _tree(11)}, {"step": 1})
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(mod, "shutil", type("S", (), {"disk_usage": staticmethod(lambda p: usage(1 << 30, 1 << 30, 1 << 20))}))
    with pytest.raises(OSError, match=r"ckpt: 0\.00 GiB free, a checkpoint needs about 0\.00 GiB; not saving step 2 "
                                      r"\(the last checkpoint, step 1, is kept\)"):
        ckpt.save(2, _tree(2), {"mu": _tree(12)}, {"step": 2})
    monkeypatch.setattr(mod, "shutil", real_shutil)
    ckpt.close()
    again = Checkpointer(str(tmp_path / "ckpt"))
    params, step = again.restore_params(None, _tree(0))
    assert step == 1
    jax.tree.map(np.testing.assert_array_equal, params, _tree(1))


def test_a_failed_background_save_is_raised_at_the_next_step_with_the_free_space(tmp_path, monkeypatch):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    ckpt.save(1, _tree(1), {"mu": _tree(11)}, {"step": 1})

    def failed():
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt.manager, "check_for_errors", failed)
    with pytest.raises(OSError, match=r"ckpt: a checkpoint save failed \(OSError: .*No space left on device\); "
                                      r"[\d.]+ GiB free there; the last complete checkpoint is step 1"):
        ckpt.check()


def test_when_no_step_restores_nothing_is_moved(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    for step in (1, 2):
        ckpt.save(step, _tree(step), {"mu": _tree(10 + step)}, {"step": step})
    ckpt.close()
    other = {"w": jnp.zeros((3, 3)), "b": jnp.zeros(5)}  # a model config that changed since
    with pytest.raises(CheckpointMismatch, match=r"step 2 was written by another model or optimizer config: "
                                                 r"params\.w is \(64, 32\) in the checkpoint, \(3, 3\) in this config\. "
                                                 r"Nothing was restored or changed"):
        Checkpointer(str(tmp_path / "ckpt")).restore_newest(other, {"mu": other})
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]


def test_a_bit_flipped_only_checkpoint_is_called_damaged_not_a_changed_config(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    ckpt.save(1, _tree(1), {"mu": _tree(11)}, {"step": 1})
    ckpt.close()
    for f in (p for p in (tmp_path / "ckpt" / "1" / "params").rglob("*") if p.is_file() and p.stat().st_size > 64):
        data = bytearray(f.read_bytes())
        for i in range(len(data) // 3, len(data) // 3 + 32):  # a run of flipped bits mid-file
            data[i] ^= 0xFF
        f.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=r"no checkpoint restores \(steps \[1\]\), though their tensors' shapes "
                                           r"match this config: their files are damaged") as e:
        Checkpointer(str(tmp_path / "ckpt")).restore_newest(_tree(0), {"mu": _tree(0)})
    assert "config changed" not in str(e.value) and "strict=False" not in str(e.value)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1"]  # nothing moved when none restores


def test_evaluate_and_export_name_the_tensor_of_another_config(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    ckpt.save(1, _tree(1), {"mu": _tree(11)}, {"step": 1})
    ckpt.close()
    other = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(5), "extra": jnp.zeros(2)}
    with pytest.raises(CheckpointMismatch, match=r"params\.extra \(2,\) is not in the checkpoint"):
        Checkpointer(str(tmp_path / "ckpt"), read_only=True).restore_params(None, other)
    with pytest.raises(CheckpointMismatch, match=r"holds 1 params tensors this config has not, first params\.b"):
        Checkpointer(str(tmp_path / "ckpt"), read_only=True).restore_params(None, {"w": jnp.zeros((64, 32))})


def test_evaluate_and_exports_restore_names_a_missing_step_and_a_damaged_one(tmp_path):
    """`evaluate --step 99` and a damaged step read for evaluation or export: one sentence naming the
    directory and the step (it was orbax's own error, about 190 lines of it); the save-failure
    message of a run with no checkpoint yet says so (it said "step None")."""
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    for step in (1, 2):
        ckpt.save(step, _tree(step), {"mu": _tree(10 + step)}, {"step": step})
    ckpt.close()
    with pytest.raises(FileNotFoundError, match=r"ckpt: no step 99 \(the steps there: \[1, 2\]\)"):
        Checkpointer(str(tmp_path / "ckpt"), read_only=True).restore_params(99, _tree(0))
    for f in (p for p in (tmp_path / "ckpt" / "2" / "params").rglob("*") if p.is_file() and p.stat().st_size > 64):
        f.write_bytes(f.read_bytes()[:16])
    with pytest.raises(RuntimeError, match=r"ckpt: step 2 is there but does not restore \(.*\); if its files are "
                                           r"damaged, evaluate or export another step \(--step\)"):
        Checkpointer(str(tmp_path / "ckpt"), read_only=True).restore_params(None, _tree(0))
    params, step = Checkpointer(str(tmp_path / "ckpt"), read_only=True).restore_params(1, _tree(0))
    assert step == 1
    jax.tree.map(np.testing.assert_array_equal, params, _tree(1))
    fresh = Checkpointer(str(tmp_path / "fresh"))
    assert str(fresh._save_failed(OSError("disk"))).endswith("the last complete checkpoint is none yet (no step saved)")
