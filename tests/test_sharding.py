"""Logical-axis rules, the mesh helper, and the sharded forward on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import write_hf_qwen2
from jax.sharding import NamedSharding, PartitionSpec as P

from sem_jax.model import from_pretrained, param_shapes
from sem_jax.model.hf_io import model_variables
from sem_jax.sharding import RULES, logical_to_spec, make_mesh


def test_rules_table():
    mesh = {"data": 2, "fsdp": 2, "tensor": 4}
    assert logical_to_spec(("layers", "embed", "heads", "head_dim"), (3, 64, 8, 8), mesh) == \
        P(None, "fsdp", "tensor")  # trailing replicated dims dropped, as jit returns specs
    # 2 KV heads do not divide over tensor=4: replicated rather than an error.
    assert logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (3, 64, 2, 8), mesh) == P(None, "fsdp")
    assert logical_to_spec(("batch", "length", "act_embed"), (8, 5, 64), mesh) == P(("data", "fsdp"))
    # A mesh axis of size 1 is dropped from the spec.
    assert logical_to_spec(("batch",), (8,), {"data": 1, "fsdp": 8, "tensor": 1}) == P("fsdp")
    # The sampler's spread layout (a `groups` axis): rows over the groups, the MLP's weights over
    # the groups too, the rows entering the MLP whole on each group; where the groups do not divide
    # a dimension it keeps the leading axes that do.
    spread = {"groups": 2, "fsdp": 1, "tensor": 4}
    assert logical_to_spec(("layers", "embed", "mlp"), (3, 64, 96), spread) == P(None, None, ("tensor", "groups"))
    assert logical_to_spec(("layers", "embed", "mlp"), (3, 64, 100), spread) == P(None, None, "tensor")
    assert logical_to_spec(("batch", "length", "act_mlp"), (8, 1, 96), spread) == P("groups", None, "tensor")
    assert logical_to_spec(("spread_rows", "length", "act_mlp"), (8, 1, 96), spread) == P(None, None, ("tensor", "groups"))
    assert logical_to_spec(("spread_rows",), (8,), mesh) == logical_to_spec(("batch",), (8,), mesh)
    assert logical_to_spec(("embed", "head_vocab"), (64, 256), spread) == P(None, ("tensor", "groups"))
    assert logical_to_spec(("spread_rows", "act_head_vocab"), (8, 256), spread) == P(None, ("tensor", "groups"))
    assert logical_to_spec(("embed", "head_vocab"), (64, 256), mesh) == logical_to_spec(("embed", "vocab"), (64, 256), mesh)
    assert logical_to_spec(("layers", "embed", "mlp"), (3, 64, 96), mesh) == P(None, "fsdp", "tensor")
    with pytest.raises(KeyError, match="nonsense"):
        logical_to_spec(("nonsense",))
    assert all(len(rule) == 2 for rule in RULES)


def test_make_mesh():
    mesh = make_mesh(data=2, fsdp=-1, tensor=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(data=2, fsdp=4, tensor=2)
    with pytest.raises(ValueError, match="at most one"):
        make_mesh(data=-1, fsdp=-1)


@pytest.mark.parametrize("axes", [(2, 2, 2), (1, 2, 4)])
def test_sharded_forward_matches_single_device(tmp_path, axes):
    assert jax.device_count() == 8, "conftest sets 8 host devices"
    write_hf_qwen2(tmp_path, vocab_size=256, hidden_size=64, intermediate_size=96,
                   num_attention_heads=8, num_key_value_heads=2)
    single = from_pretrained(str(tmp_path))
    mesh = make_mesh(*axes)
    sharded = from_pretrained(str(tmp_path), mesh=mesh)

    shapes = param_shapes(sharded.config)
    for name, var in model_variables(sharded).items():
        shape, names = shapes[name]
        spec = logical_to_spec(names, shape, dict(mesh.shape))
        arr = var[...]
        assert isinstance(arr.sharding, NamedSharding) and arr.sharding.spec == spec, name
        # Each device really holds only its slice.
        expect = tuple(d // np.prod([mesh.shape[a] for a in ((s,) if isinstance(s, str) else s)])
                       if s else d for d, s in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))))
        assert arr.addressable_shards[0].data.shape == expect, name
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(model_variables(single)[name][...]))
    q = model_variables(sharded)["layers.q_kernel"][...]
    assert q.addressable_shards[0].data.shape[2] == 8 // axes[2]  # heads split by tensor

    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 256, (4, 12)))
    want = np.asarray(single(tokens))
    with jax.set_mesh(mesh):
        tokens_sharded = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"))))
        got = jax.jit(lambda m, t: m(t))(sharded, tokens_sharded)
    assert len(got.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)
