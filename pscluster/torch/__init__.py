"""PyTorch models on pscluster (`pip install pscluster[torch]`): parameters on the PS, steps on workers.

    import pscluster.torch as ps_torch
    model = ps_torch.PSModule(coord, net, ps_torch.SGD(lr=0.05, momentum=0.9))

    def step(iterator):
        x, y = next(iterator)
        net = model.pull()                      # every parameter, one request per PS task
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        model.push()                            # every gradient, one push id
        return loss.item()

    coord.schedule(step, args=(per_worker_iter,)); coord.join()
    net.load_state_dict(model.state_dict())

Sparse `nn.Embedding`/`nn.EmbeddingBag(sparse=True)` weights are sparse PS tables: `pull(ids={"emb": ids})`
pulls only the rows the batch touches and `push()` sends only their gradients. `DynamicEmbedding` stands in
for either over raw int64 ids, on a hash-keyed dynamic table (pscluster/torch/dynamic.py). The core never imports
torch; only this package does.
"""

from pscluster.torch.dynamic import DynamicEmbedding
from pscluster.torch.fit import fit
from pscluster.torch.module import PSModule
from pscluster.torch.optim import SGD, Adagrad, Adam, AdamW, ParamGroups, RMSprop, from_torch

__all__ = ["Adagrad", "Adam", "AdamW", "DynamicEmbedding", "PSModule", "ParamGroups", "RMSprop", "SGD", "fit",
           "from_torch"]
