"""Host-local rows <-> global arrays (sem_jax.hosts), with one process and with two."""

import os
import sys
import textwrap

import jax.numpy as jnp
import numpy as np

from sem_jax import hosts
from sem_jax.rl.trainer import _micro, _unmicro
from sem_jax.sharding import make_mesh
from subprocs import free_address, run_together

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_one_process_round_trip_and_micro_batches():
    mesh = make_mesh(data=2, fsdp=4)
    assert hosts.batch_shards(mesh) == 8 and hosts.local_batch_multiple(mesh) == 8
    rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    x = hosts.to_global(rows, mesh)
    assert len({tuple(s.index[0].indices(16)) for s in x.addressable_shards}) == 8  # split 8 ways
    np.testing.assert_array_equal(hosts.to_local(x), rows)
    assert hosts.agree_max(5) == 5 and hosts.gather_json({"a": [1]}) == [{"a": [1]}]
    assert hosts.agree_max_each(True, 3, -2) == (1, 3, -2)
    # Strided micro-batches: each holds rows from every shard, and _unmicro undoes _micro.
    mb = _micro({"x": jnp.asarray(rows)}, 4)["x"]
    assert mb.shape == (4, 4, 3)
    np.testing.assert_array_equal(np.asarray(mb[1, :, 0]), rows[[1, 5, 9, 13], 0])
    np.testing.assert_array_equal(np.asarray(_unmicro(mb)), rows)
    # Runs of 2 rows (a group's shared prompt) stay together: micro-batch 1 holds runs 1 and 5.
    mb = _micro({"x": jnp.asarray(rows)}, 4, unit=2)["x"]
    assert mb.shape == (4, 4, 3)
    np.testing.assert_array_equal(np.asarray(mb[1, :, 0]), rows[[2, 3, 10, 11], 0])
    np.testing.assert_array_equal(np.asarray(_unmicro(mb, unit=2)), rows)


_TWO = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    import jax.numpy as jnp, numpy as np
    from sem_jax import hosts
    from sem_jax.sharding import make_mesh
    pid = jax.process_index()
    mesh = make_mesh(fsdp=-1)
    local = np.full((2, 3), pid, np.int32) + np.arange(2)[:, None] * 10
    x = hosts.to_global(local, mesh)
    assert x.shape == (4, 3), x.shape
    assert (hosts.to_local(x) == local).all()
    total = int(jax.jit(jnp.sum)(x))  # a collective over both processes' rows
    assert total == 3 * (0 + 10 + 1 + 11), total
    assert hosts.agree_max(7 + pid) == 8
    assert hosts.agree_max_each(pid, 1 - pid, -(5 + pid)) == (1, 1, -5)  # each value's own maximum
    assert hosts.gather_json({"pid": pid, "s": "x" * (5 * pid)}) == [{"pid": 0, "s": ""}, {"pid": 1, "s": "xxxxx"}]
    try:
        hosts.to_global(np.zeros((1, 3)), mesh)  # 2 rows over 4 shards
        raise SystemExit("uneven rows accepted")
    except ValueError as e:
        assert "batch shards" in str(e)
    log = hosts.CallLog(True)
    log.record("decode", np.zeros((4, 8)))
    log.check("same calls")
    log.record("insert", np.zeros((4, 8 + 8 * pid)))  # process 1 would compile another shape
    try:
        log.check("step 1")
        raise SystemExit("mismatch not detected")
    except RuntimeError as e:
        assert "step 1: processes made different device calls" in str(e) and "(4, 16)" in str(e), e
    hosts.check_shared_dir(sys.argv[3])
    try:
        hosts.check_shared_dir(sys.argv[3] + f"/own{pid}")  # a directory only this process writes to
        raise SystemExit("unshared run_dir accepted")
    except RuntimeError as e:
        assert "is not shared" in str(e), e
    print("ok", pid)
""")


def test_two_processes_share_rows_agree_and_catch_diverging_calls(tmp_path):
    addr = free_address()
    for i in (0, 1):
        (tmp_path / f"own{i}").mkdir()
    outs = run_together([([sys.executable, "-c", _TWO, addr, str(i), str(tmp_path)], 2) for i in (0, 1)], REPO,
                        timeout=300)
    for i, out in enumerate(outs):
        assert f"ok {i}" in out, out[-3000:]
