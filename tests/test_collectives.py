"""The interconnect bytes of a compiled program against a hand count of its collectives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sem_jax.aot.collectives import group_size, ici_bytes


def test_each_collective_is_charged_what_a_ring_sends():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("d", "t"), axis_types=(AxisType.Auto,) * 2)

    def f(x, y):
        a = jax.lax.psum(x, "t")                                     # [8, 8] over 4
        b = jax.lax.all_gather(y, "d", tiled=True)                   # [4, 16] -> [8, 16] over 2
        c = jax.lax.psum_scatter(b * 2, "d", tiled=True)             # [8, 16] -> [4, 16] over 2
        e = jax.lax.all_to_all(x, "t", 0, 1, tiled=True)             # [8, 8] over 4
        g = jax.lax.ppermute(y, "d", [(0, 1), (1, 0)])               # [4, 16]
        return a, b, c, e, g

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("d", "t"), P("d")), check_vma=False,
                               out_specs=(P("d"), P(), P("d"), P("d", "t"), P("d"))))
    arg = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
    hlo = fn.lower(arg((16, 32), P("d", "t")), arg((8, 16), P("d"))).compile().as_text()
    f32 = 4
    hand = (2 * 3 / 4 * 8 * 8 * f32     # all-reduce: 2 (n-1)/n of the array
            + 1 / 2 * 8 * 16 * f32      # all-gather: (n-1)/n of the result
            + 1 * 4 * 16 * f32          # reduce-scatter: (n-1) x each device's piece
            + 3 / 4 * 8 * 8 * f32       # all-to-all: (n-1)/n of what is exchanged
            + 4 * 16 * f32)             # collective-permute: what is sent
    assert ici_bytes(hlo) == pytest.approx(hand)


def test_an_fsdp_gradient_gathers_the_weight_and_reduces_its_gradient():
    """Groups of every device (printed as a named mesh): the weight's all-gather forward, the
    gradient's all-reduce backward."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("f",), axis_types=(AxisType.Auto,))
    arg = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("f")))
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)))
    hlo = grad.lower(arg((64, 64)), arg((8, 64))).compile().as_text()
    weight = 64 * 64 * 4
    assert ici_bytes(hlo) == pytest.approx(7 / 8 * weight + 2 * 7 / 8 * weight)


def test_the_tpu_text_forms_are_read():
    """Async halves, layouts with tiles and memory spaces, iota replica groups; -done not charged."""
    hlo = "\n".join([
        "%ag = (bf16[80,128]{1,0:T(8,128)(2,1)}, bf16[320,128]{1,0:T(8,128)(2,1)S(3)}) all-gather-start(%p), "
        "channel_id=1, replica_groups=[4,4]<=[16], dimensions={0}",
        "%agd = bf16[320,128]{1,0} all-gather-done(%ag)",
        "%cp = (bf16[80,128]{1,0}, bf16[80,128]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%q), "
        "source_target_pairs={{0,1},{1,0}}",
        "%ar = (f32[16]{0}, bf16[8,8]{1,0}) all-reduce-start(%a, %b), replica_groups={{0,1},{2,3}}, to_apply=%add",
        "%x = f32[8]{0} add(%y, %z)",
        "%rs = bf16[4,8]{1,0} reduce-scatter(%w), replica_groups=mesh['a'=2,'b'=4] {'a','b'}, dimensions={0}",
        "%all = bf16[4,8]{1,0} all-reduce(%w), replica_groups={}, to_apply=%add",
        # A reduce-scatter as the TPU compiler fuses it: an all-reduce and its slice, charged (n-1)/n.
        "%all-reduce-scatter.clone.1 (input.4: bf16[320,128]) -> bf16[80,128] {",
        "  %input.4 = bf16[320,128]{1,0:T(8,128)(2,1)} parameter(0)",
        "  %all-reduce.75 = bf16[320,128]{1,0:T(8,128)(2,1)} all-reduce(%input.4), channel_id=19, "
        "replica_groups={{0,4,8,12},{1,5,9,13},{2,6,10,14},{3,7,11,15}}, to_apply=%add.6.clone",
        "  ROOT %dynamic-slice.449 = bf16[80,128]{1,0} dynamic-slice(%all-reduce.75, %m, %c), dynamic_slice_sizes={80,128}",
        "}",
        "%fused_computation.2 (p: f32[8,8]) -> f32[8,8] {",
        "  %after = f32[8,8]{1,0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add",
        "}",
    ])
    assert group_size(hlo.splitlines()[0]) == 4
    hand = (3 / 4 * 320 * 128 * 2 + 80 * 128 * 2 + 2 * 1 / 2 * (16 * 4 + 64 * 2)
            + 7 * 4 * 8 * 2  # the reduce-scatter over both axes (8 devices)
            + 3 / 4 * 320 * 128 * 2 + 2 * 1 / 2 * 8 * 8 * 4)  # the fused reduce-scatter; a plain all-reduce after it
    assert ici_bytes(hlo) == pytest.approx(hand)  # {} without num_partitions: no group known, not charged
    module = "HloModule jit_step, num_partitions=16\n" + hlo
    assert ici_bytes(module) == pytest.approx(hand + 2 * 15 / 16 * 4 * 8 * 2)
