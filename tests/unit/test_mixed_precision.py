"""Mixed precision: bfloat16/float16 modules keep float32 masters on the PS, push half the bytes, and the PS
upcasts before its optimizer; dynamic loss scaling for float16; modules on CUDA through a staging buffer.

The PS side is the real VariableStore; the client in between is a small in-process backend that moves
arrays the way the transports do (pull fills the caller's arrays, push hands the store the pushed arrays).
"""

import ml_dtypes
import numpy as np
import pytest
import torch
from pscluster.server.store import PushItem, ShardSpec, VariableStore
from torch import nn

import pscluster.torch as ps_torch
from pscluster import codec, gradients
from pscluster.client import context
from pscluster.client.plans import as_grad
from pscluster.client.variables import ShardPlacement, Variable
from pscluster.errors import InvalidArgumentError
from pscluster.optimizers import SGD
from pscluster.torch.precision import Staging

BF16 = np.dtype(ml_dtypes.bfloat16)


class StoreBackend:
    """Variables of one shard each in a real VariableStore; records what every push carried."""

    def __init__(self):
        self.store = VariableStore()
        self.pushed = []

    def create_variable(self, name, shape=None, dtype=None, *, initial_value=None, optimizer=None, **_):
        value = np.asarray(initial_value)
        spec = ShardSpec(name, 0, 1, value.shape, value.shape, 0, value.dtype.str, optimizer)
        self.store.create(spec, value.copy())
        rows = value.shape[0] if value.shape else 1
        return Variable(name, value.shape, value.dtype, (ShardPlacement(0, 0, 0, rows, 0),))

    def pull_into(self, dense, rows=()):
        for var, out in dense:
            out[...] = self.store.get((var.name, 0)).value

    def pull(self, variables):
        return [self.store.get((v.name, 0)).value.copy() for v in variables]

    def push(self, grads, push_id=None, step=0, rows=(), nonfinite=None, max_norm=None, norm_type=2.0, unclipped=0):
        screened = gradients.screen(grads, rows, nonfinite=nonfinite or "reject", max_norm=max_norm,
                                    norm_type=norm_type, unclipped=unclipped)  # as the client does
        if screened is None:
            return []
        grads = screened[0]
        self.pushed.append({var.name: g for var, g in grads})
        items = [PushItem((var.name, 0), as_grad(var, g, var.shape)) for var, g in grads]
        return [r.version for r in self.store.push(push_id or "", items)]


def test_bfloat16_travels_under_its_name_and_round_trips():
    grad = np.array([1.5, -2.0, 3.0e-3], BF16)
    msg = codec.encode(grad)
    assert msg.dtype == "bfloat16" and len(msg.data) == 6
    back = codec.decode(msg)
    assert back.dtype == BF16 and np.array_equal(back.astype(np.float32), grad.astype(np.float32))
    assert codec.header(BF16, (3,)).dtype == "bfloat16" and codec.header(np.dtype(np.float16), (3,)).dtype == "<f2"


@pytest.mark.parametrize("half", [np.float16, BF16])
def test_the_ps_upcasts_a_half_gradient_into_its_float32_master(half):
    store = VariableStore()
    w = np.linspace(-1, 1, 6, dtype=np.float32)
    store.create(ShardSpec("w", 0, 1, (6,), (6,), 0, "<f4", SGD(0.5)), w.copy())
    grad = np.array([0.1, 0.2, 0.3, -0.4, 1e-3, 7.0], half)
    store.push("p1", [PushItem(("w", 0), grad)])
    np.testing.assert_array_equal(store.get(("w", 0)).value, w - np.float32(0.5) * grad.astype(np.float32))
    with pytest.raises(InvalidArgumentError, match="gradient dtype float64 does not match variable dtype float32"):
        store.push("p2", [PushItem(("w", 0), np.zeros(6))])
    assert as_grad(Variable("w", (6,), np.dtype(np.float32), ()), grad, (6,)).dtype == grad.dtype  # stays half
    assert as_grad(Variable("w", (6,), np.dtype(np.float32), ()), np.zeros(6), (6,)).dtype == np.float32


def test_a_bfloat16_variable_is_refused_with_the_way_to_do_it():
    spec = ShardSpec("w", 0, 1, (2,), (2,), 0, "bfloat16", SGD(0.1))
    with pytest.raises(InvalidArgumentError, match="keep float32 masters on the PS"):
        spec.validate()


def tiny(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_module_pulls_cast_masters_pushes_half_gradients_and_state_dict_is_float32(dtype):
    backend = StoreBackend()
    net = tiny(torch.float32)
    model = ps_torch.PSModule(backend, tiny(dtype), SGD(0.1))
    masters = {name: backend.store.get((name, 0)).value.copy() for name in model.variables}
    assert all(v.dtype in (np.float32, np.int64) for v in masters.values())
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with context.ClosureScope(1, client=backend):
        replica = model.pull()
        for name, param in replica.named_parameters():
            assert param.dtype == dtype
            torch.testing.assert_close(param, torch.from_numpy(masters[name]).to(dtype), rtol=0, atol=0)
        loss = nn.functional.cross_entropy(replica(x.to(dtype)).float(), y)
        model.backward(loss)
        model.push()
        grads = {name: p.grad for name, p in replica.named_parameters()}
    pushed = backend.pushed[0]
    for name, grad in grads.items():
        assert pushed[name].nbytes == masters[name].nbytes // 2  # half the bytes of float32
        np.testing.assert_array_equal(backend.store.get((name, 0)).value,
                                      masters[name] - np.float32(0.1) * grad.float().numpy())
    with context.ClosureScope(2, client=backend):
        state = model.state_dict()
    assert all(t.dtype in (torch.float32, torch.int64) for t in state.values())
    net.load_state_dict(state)  # the float32 masters load into a float32 copy of the module


def test_dynamic_loss_scaling_skips_and_counts_a_non_finite_step_and_unscales_the_others():
    backend = StoreBackend()
    model = ps_torch.PSModule(backend, nn.Linear(4, 1).half(), SGD(0.1), loss_scale="dynamic")
    w0 = backend.store.get(("weight", 0)).value.copy()
    with context.ClosureScope(1, client=backend):
        net = model.pull()
        model.backward(net(torch.full((2, 4), 1e4, dtype=torch.float16)).float().sum())  # x scale: inf in float16
        assert model.push() == [] and backend.pushed == []  # no PS sees the step
        assert model.precision_logs() == {"loss_scale": 2.0 ** 15, "skipped_steps": 1.0}
        net = model.pull()
        x = torch.full((1, 4), 0.5, dtype=torch.float16)  # scaled by 2 ** 15 in backward: still finite
        model.backward(net(x).float().sum())
        model.push()
    np.testing.assert_array_equal(backend.pushed[0]["weight"], np.full((1, 4), 0.5, np.float16))  # unscaled
    np.testing.assert_allclose(backend.store.get(("weight", 0)).value, w0 - np.float32(0.05))
    with pytest.raises(InvalidArgumentError, match="loss_scale=2.0"):
        ps_torch.PSModule(backend, nn.Linear(4, 1), loss_scale=2.0)


def test_the_staging_buffer_holds_every_staged_tensor_aligned_and_is_reused():
    staging = Staging()
    views = staging.views([(np.dtype(np.float32), (3, 5)), (np.dtype(np.int64), ()), (np.dtype(np.float32), (7,))])
    assert [v.shape for v in views] == [(3, 5), (), (7,)] and views[1].dtype == np.int64
    assert all(v.ctypes.data % 64 == 0 for v in views)
    again = staging.views([(np.dtype(np.float32), (2,))])
    assert again[0].ctypes.data == views[0].ctypes.data  # the same memory, not a new buffer per pull


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_module_on_cuda_pulls_through_the_pinned_staging_buffer_and_pushes_from_the_device(dtype):
    backend = StoreBackend()
    model = ps_torch.PSModule(backend, tiny(dtype), SGD(0.1))
    model.skeleton.to("cuda")
    wire = BF16 if dtype == torch.bfloat16 else np.dtype(np.float32)
    with context.ClosureScope(1, client=backend):
        replica = model.pull()
        assert all(p.device.type == "cuda" for p in replica.parameters())
        assert model._replica().staging._buffer.is_pinned()  # one page-locked host buffer, not a copy per tensor
        masters = {name: backend.store.get((name, 0)).value.copy() for name, _ in replica.named_parameters()}
        for name, param in replica.named_parameters():
            np.testing.assert_array_equal(param.float().cpu().numpy(), masters[name].astype(wire).astype(np.float32))
        loss = nn.functional.cross_entropy(replica(torch.randn(8, 4, device="cuda", dtype=dtype)).float(),
                                           torch.randint(0, 2, (8,), device="cuda"))
        model.backward(loss)
        model.push()
        grads = {name: p.grad.float().cpu().numpy() for name, p in replica.named_parameters()}
    assert all(backend.pushed[0][name].dtype == wire for name in grads)
    for name, grad in grads.items():  # the PS applied exactly the gradient computed on the device
        np.testing.assert_array_equal(backend.store.get((name, 0)).value, masters[name] - np.float32(0.1) * grad)
