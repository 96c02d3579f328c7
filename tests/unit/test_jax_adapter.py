"""pscluster.jax without a cluster: pytree leaves map onto named variables; bad definitions create nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pscluster.jax as ps_jax
from pscluster.errors import InvalidArgumentError


class Recorder:
    """Stands in for the coordinator's create_variable: records the definitions the adapter makes."""

    def __init__(self):
        self.created = {}

    def create_variable(self, name, **kwargs):
        self.created[name] = kwargs
        return name


PARAMS = {"emb": jnp.zeros((10, 4)), "layers": [{"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}], "scale": jnp.ones(())}


def test_a_table_given_by_shape_is_initialised_on_the_ps():
    rec = Recorder()
    ps_jax.PSParams(rec, {"emb": jax.ShapeDtypeStruct((10**7, 64), jnp.float32)}, sparse=["emb"], table_init=0.1,
                    seed=3)
    fields = rec.created["emb"]
    assert "initial_value" not in fields and fields["shape"] == (10**7, 64) and fields["dtype"] == np.float32
    assert (fields["initializer"], fields["init_scale"], fields["seed"]) == ("normal", 0.1, 3)


def test_leaves_become_variables_named_by_their_path():
    rec = Recorder()
    model = ps_jax.PSParams(rec, PARAMS, ps_jax.Adam(0.01), sparse=["emb"], prefix="m.")
    assert model.names == ["emb", "layers/0/b", "layers/0/w", "scale"]
    assert set(rec.created) == {"m.emb", "m.layers/0/b", "m.layers/0/w", "m.scale"}
    assert rec.created["m.emb"]["sparse"] and not rec.created["m.layers/0/w"]["sparse"]
    assert rec.created["m.scale"]["partitioner"] is None  # a scalar is never split
    np.testing.assert_array_equal(rec.created["m.layers/0/w"]["initial_value"], np.ones((4, 2), np.float32))
    assert rec.created["m.emb"]["optimizer"].kind == "adam" and rec.created["m.emb"]["optimizer"].epsilon == 1e-8


@pytest.mark.parametrize("params, sparse, match", [
    ({"a/b": jnp.ones(1), "a": {"b": jnp.ones(1)}}, (), r"leaves \['a/b'\] have the same name"),
    (PARAMS, ["table"], r"sparse=\['table'\]: no such leaf"),
    (PARAMS, ["scale"], "scale: a sparse table needs at least one axis"),
    ({"mask": jnp.array([True, False])}, (), "mask: dtype bool has no PS equivalent"),
    ({"w": jax.ShapeDtypeStruct((3,), jnp.float32)}, (), "w: only a sparse table may be given as a ShapeDtypeStruct"),
])
def test_bad_definitions_are_refused_before_any_variable_is_created(params, sparse, match):
    rec = Recorder()
    with pytest.raises(InvalidArgumentError, match=match):
        ps_jax.PSParams(rec, params, sparse=sparse)
    assert rec.created == {}


@pytest.mark.parametrize("kwargs, match", [
    ({"nonfinite": "ignore"}, r"nonfinite='ignore': use one of \('reject', 'skip', 'allow'\)"),
    ({"max_norm": 0.0}, "max_norm=0.0: must be a finite number > 0"),
    ({"max_norm": 1.0, "norm_type": -1.0}, "norm_type=-1.0: must be > 0 or math.inf"),
])
def test_bad_nonfinite_or_clipping_options_are_refused_before_any_variable_is_created(kwargs, match):
    rec = Recorder()
    with pytest.raises(InvalidArgumentError, match=match):
        ps_jax.PSParams(rec, PARAMS, **kwargs)
    assert rec.created == {}
