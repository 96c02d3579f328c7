"""pscluster.torch without a cluster: torch optimizers map onto PS ones; sparse tables are found."""

import pytest
import torch
from torch import nn

import pscluster.torch as ps_torch
from pscluster.errors import InvalidArgumentError
from pscluster.torch.tables import sparse_tables


@pytest.mark.parametrize("make, kind, fields", [
    (lambda p: torch.optim.SGD(p, lr=0.1), "sgd", {"learning_rate": 0.1}),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), "momentum",
     {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    (lambda p: torch.optim.Adagrad(p, lr=0.05), "adagrad",
     {"learning_rate": 0.05, "initial_accumulator_value": 0.0, "epsilon": 1e-10}),
    (lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.8, 0.99), eps=1e-6), "adam",
     {"beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6}),
    (lambda p: torch.optim.SparseAdam(p, lr=1e-2), "adam", {"learning_rate": 1e-2, "epsilon": 1e-8}),
])
def test_torch_optimizers_map_onto_ps_optimizers_with_their_hyperparameters(make, kind, fields):
    cfg = ps_torch.from_torch(make(nn.Linear(2, 2).parameters()))
    assert cfg.kind == kind
    for name, value in fields.items():
        assert getattr(cfg, name) == pytest.approx(value), name


@pytest.mark.parametrize("make, message", [
    (lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), r"SGD\(maximize=True\) is not supported"),
    (lambda p: torch.optim.Adadelta(p), "Adadelta has no PS equivalent"),
    (lambda p: torch.optim.Adamax(p), "Adamax has no PS equivalent"),
])
def test_unsupported_torch_optimizer_settings_are_rejected_by_name(make, message):
    with pytest.raises(InvalidArgumentError, match=message):
        ps_torch.from_torch(make(list(nn.Linear(2, 2).parameters())))


def test_torch_named_constructors_use_torch_defaults():
    assert ps_torch.SGD().learning_rate == 1e-3 and ps_torch.SGD(momentum=0.5).kind == "momentum"
    assert ps_torch.Adam().epsilon == 1e-8 and ps_torch.Adagrad().initial_accumulator_value == 0.0
    with pytest.raises(InvalidArgumentError, match="nesterov needs momentum > 0"):
        ps_torch.SGD(nesterov=True)


def test_only_sparse_embeddings_are_tables():
    net = nn.ModuleDict({"a": nn.Embedding(5, 2, sparse=True), "b": nn.Embedding(5, 2),
                         "c": nn.EmbeddingBag(5, 2, sparse=True)})
    assert sparse_tables(net) == {"a.weight": "a", "c.weight": "c"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fit_computes_a_reduced_precision_modules_loss_in_float32_as_autocast_does(dtype):
    from torch.nn import functional as F  # noqa: N812

    from pscluster.torch.fit import loss_input

    torch.manual_seed(0)
    logits = (4 * torch.randn(256, 10)).to(dtype).requires_grad_()
    targets = torch.randint(0, 10, (256,))
    loss = F.cross_entropy(loss_input(logits), targets)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(F.cross_entropy(logits.detach().double(), targets).item(), rel=1e-6)
    loss.backward()
    assert logits.grad is not None and logits.grad.dtype == dtype  # the backward pass stays in the module's dtype
    float32 = torch.zeros(2, 3)
    assert loss_input(float32) is float32
