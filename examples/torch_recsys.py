"""A click model with two sparse embedding tables of 1 M rows each, trained on a local pscluster.

    python examples/torch_recsys.py --steps 1000                # 2 PS, 2 workers, Adagrad on the PS
    python examples/torch_recsys.py --rows 10000000 --dim 16    # larger tables: workers hold only batch rows
    python examples/torch_recsys.py --hashed --steps 1000       # raw hashed int64 ids on dynamic tables

Model: user and item `nn.Embedding(rows, dim, sparse=True)` tables (created on the meta device, so
neither the driver nor a worker ever holds a table: the PS initialises them) and a linear layer over
[user * item, user, item]. A step pulls only the rows its batch touches and pushes only their
gradients.

Data (synthetic, with a learnable signal): ids follow a heavy-tailed popularity law (id rank =
rows * u**4, scattered over the table by a bijective hash), and a click happens with probability
sigmoid(2 (a_user + b_item) + 2 <p_user, q_item> / sqrt(k)), where a, b, p, q are fixed pseudo-random
functions of the id. Held-out AUC (fresh samples from the same law) is printed: 0.5 is chance, the
true click law itself scores 0.84 on 20,000 samples.

`--hashed`: the model sees each id only as a hashed 64-bit feature id (any int64), and the tables are
hash-keyed dynamic tables (`create_variable(shape=(None, dim), sparse=True)`, one
`ps_torch.DynamicEmbedding` each): a key gets a row after `--admit` occurrences, rows untouched for
`--max-idle` pushes are evicted every 50 pushes, and each shard holds at most `--capacity` rows. The
live size of both tables, the evicted keys and the dropped (not yet admitted) gradient rows are
printed as training goes.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn

import pscluster as ps
import pscluster.torch as ps_torch
from pscluster.ops.launcher import LocalCluster
from pscluster.tables import Admission, Eviction, TableConfig, mix64

LATENT = 4  # k, the dimension of the true user/item factors


# -- data -----------------------------------------------------------------------------------------
def _hash_uniform(ids: np.ndarray, salt: int) -> np.ndarray:
    """A fixed pseudo-random value in [-1, 1) per id (splitmix64; no table of size rows is ever built)."""
    h = ids.astype(np.uint64) + np.uint64((salt * 0x9E3779B97F4A7C15) % 2**64)
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    return (h >> np.uint64(40)).astype(np.float64) / float(1 << 23) - 1.0


def _popular_ids(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    rank = np.minimum((rows * rng.random(n) ** 4).astype(np.int64), rows - 1)
    return (rank * 1_000_003) % rows  # a bijection (1,000,003 is prime): hot ids spread over every shard


def clicks(rows: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n samples (users, items, clicked) of the synthetic click law."""
    users, items = _popular_ids(rng, rows, n), _popular_ids(rng, rows, n)
    logit = 2 * (_hash_uniform(users, 1) + _hash_uniform(items, 2))
    logit += 2 * sum(_hash_uniform(users, 10 + k) * _hash_uniform(items, 20 + k) for k in range(LATENT)) / LATENT ** 0.5
    clicked = rng.random(n) < 1 / (1 + np.exp(-logit))
    return users, items, clicked.astype(np.float32)


def click_batches(rows: int, batch: int, seed: int):
    """Endless training batches for one worker."""
    rng = np.random.default_rng([seed, 7])
    while True:
        yield clicks(rows, batch, rng)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


# -- model ----------------------------------------------------------------------------------------
class ClickModel(nn.Module):
    """Two sparse tables and a linear layer over [user * item, user, item]."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.user = nn.Embedding(rows, dim, sparse=True, device="meta")
        self.item = nn.Embedding(rows, dim, sparse=True, device="meta")
        self.out = nn.Linear(3 * dim, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        u, i = self.user(users), self.item(items)
        return self.out(torch.cat([u * i, u, i], 1)).squeeze(1)


def feature_ids(ids: np.ndarray, salt: int) -> torch.Tensor:
    """The raw 64-bit feature id a production system would see for an id: any int64."""
    return torch.from_numpy(mix64(ids, salt).view(np.int64))


class HashedClickModel(nn.Module):
    """The same model over raw feature ids: user and item rows come from dynamic tables."""

    def __init__(self, user: ps.Variable, item: ps.Variable, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.user, self.item = ps_torch.DynamicEmbedding(user), ps_torch.DynamicEmbedding(item)
        self.out = nn.Linear(3 * dim, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        u, i = self.user(users), self.item(items)
        return self.out(torch.cat([u * i, u, i], 1)).squeeze(1)


def make_hashed_step(model: ps_torch.PSModule):
    """A closure body for --hashed: dense layer through PSModule, the two tables through their own pushes."""

    def train_step(iterator) -> float:
        users, items, clicked = next(iterator)
        net = model.pull()
        logits = net(feature_ids(users, 1), feature_ids(items, 2))
        loss = nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(clicked))
        loss.backward()
        model.push()
        net.user.push()
        net.item.push()
        return loss.item()

    return train_step


def hashed_tables(coord: ps.ClusterCoordinator, args: argparse.Namespace) -> list[ps.Variable]:
    """The user and item dynamic tables of --hashed."""
    cfg = TableConfig(dim=args.dim, capacity=args.capacity, initializer="normal", init_value=0.1,
                      admission=Admission("counter", min_count=args.admit),
                      eviction=Eviction("steps", max_idle=args.max_idle, every_steps=50))
    return [coord.create_variable(name, shape=(None, args.dim), sparse=True, table=cfg,
                                  optimizer=ps_torch.Adagrad(lr=args.lr)) for name in ("user_ids", "item_ids")]


def train_hashed(coord: ps.ClusterCoordinator, args: argparse.Namespace) -> tuple[list[float], float, float]:
    """--hashed: train in 5 rounds, printing the tables' live size and held-out AUC after each;
    (losses, seconds of training, the last held-out AUC)."""
    user, item = hashed_tables(coord, args)
    model = ps_torch.PSModule(coord, HashedClickModel(user, item, args.dim), ps_torch.Adagrad(lr=args.lr))
    rows, batch = args.rows, args.batch
    dataset = coord.create_per_worker_dataset(lambda info: click_batches(rows, batch, info.worker_index))
    iterator, step = iter(dataset), make_hashed_step(model)
    losses: list[float] = []
    seconds, score = 0.0, float("nan")
    for r in range(5):
        n = args.steps // 5 + (1 if r < args.steps % 5 else 0)
        start = time.perf_counter()
        losses += coord.fetch([coord.schedule(step, args=(iterator,)) for _ in range(n)])
        seconds += time.perf_counter() - start
        stats = [coord.client.table_stats(t) for t in (user, item)]
        score = hashed_auc(model, args)
        print(f"after {len(losses)} steps: live keys user {stats[0]['live_keys']:,}, item {stats[1]['live_keys']:,}; "
              f"evicted {sum(s['evicted_keys'] for s in stats):,}; "
              f"dropped rows {sum(s['dropped_rows'] for s in stats):,}; held-out AUC {score:.4f}", flush=True)
    return losses, seconds, score


def hashed_auc(model: ps_torch.PSModule, args: argparse.Namespace) -> float:
    """Held-out AUC of --hashed's model on fresh samples (their unadmitted ids read the initializer's rows)."""
    users, items, clicked = clicks(args.rows, args.eval_samples, np.random.default_rng(12345))
    net = model.pull()
    with torch.no_grad():
        return auc(net(feature_ids(users, 1), feature_ids(items, 2)).numpy(), clicked)


def make_step(model: ps_torch.PSModule):
    """A closure body: pull the batch's rows and the dense layer, backward, push; returns the loss."""

    def train_step(iterator) -> float:
        users, items, clicked = (torch.from_numpy(a) for a in next(iterator))
        net = model.pull(ids={"user": users, "item": items})
        loss = nn.functional.binary_cross_entropy_with_logits(net(users, items), clicked)
        loss.backward()
        model.push()
        return loss.item()

    return train_step


def evaluate(model: ps_torch.PSModule, rows: int, n: int) -> float:
    """Held-out AUC on n fresh samples, pulling only the rows they touch."""
    users, items, clicked = clicks(rows, n, np.random.default_rng(12345))
    u, i = torch.from_numpy(users), torch.from_numpy(items)
    net = model.pull(ids={"user": u, "item": i})
    with torch.no_grad():
        return auc(net(u, i).numpy(), clicked)


def peak_rss_mib(pid: int) -> float:
    """Peak resident memory (VmHWM) of a process, from /proc (Linux); nan elsewhere."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    """Start a local cluster, train the click model, print held-out AUC."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of each embedding table")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--eval-samples", type=int, default=20_000)
    parser.add_argument("--min-auc", type=float, default=0.6, help="exit non-zero below this")
    parser.add_argument("--hashed", action="store_true", help="raw hashed int64 ids on dynamic tables")
    parser.add_argument("--admit", type=int, default=2, help="--hashed: occurrences before a key gets a row")
    parser.add_argument("--max-idle", type=int, default=400, help="--hashed: evict rows untouched this many pushes")
    parser.add_argument("--capacity", type=int, default=1 << 20, help="--hashed: rows per shard at most")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    mib = 2 * args.rows * args.dim * 4 / 2**20
    what = (f"2 dynamic tables of {args.dim} float32 per key (at most {args.capacity:,} rows per shard), ids drawn "
            f"from {args.rows:,}" if args.hashed else f"2 x {args.rows:,} rows x {args.dim} float32 ({mib:.0f} MiB on the PS)")
    print(f"tables: {what}; "
          f"cluster: {args.ps} PS, {args.workers} workers on 127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="pscluster-torch-recsys-") as tmp:
        with LocalCluster(args.ps, args.workers, workdir=pathlib.Path(tmp, "cluster")) as cluster:
            coord = ps.ClusterCoordinator(cluster.settings())
            try:
                coord.wait_for_workers(args.workers)
                if args.hashed:
                    losses, seconds, score = train_hashed(coord, args)
                    workers_mib = [peak_rss_mib(d.pid) for d in cluster.workers]
                    ps_mib = [peak_rss_mib(d.pid) for d in cluster.ps]
                    return _report(args, losses, seconds, score, workers_mib, ps_mib)
                model = ps_torch.PSModule(coord, ClickModel(args.rows, args.dim), ps_torch.Adagrad(lr=args.lr),
                                          partitioner=ps.FixedShardsPartitioner(args.ps), table_init=0.1)
                rows, batch = args.rows, args.batch
                dataset = coord.create_per_worker_dataset(lambda info: click_batches(rows, batch, info.worker_index))
                iterator, step = iter(dataset), make_step(model)
                start = time.perf_counter()
                losses = coord.fetch([coord.schedule(step, args=(iterator,)) for _ in range(args.steps)])
                seconds = time.perf_counter() - start
                score = evaluate(model, args.rows, args.eval_samples)
                workers_mib = [peak_rss_mib(d.pid) for d in cluster.workers]
                ps_mib = [peak_rss_mib(d.pid) for d in cluster.ps]
            finally:
                coord.shutdown()
    return _report(args, losses, seconds, score, workers_mib, ps_mib)


def _report(args: argparse.Namespace, losses: list[float], seconds: float, score: float,
            workers_mib: list[float], ps_mib: list[float]) -> int:
    print(f"{args.steps} steps of {args.batch} in {seconds:.1f} s ({args.steps / seconds:.0f} steps/s); "
          f"loss {np.mean(losses[:20]):.3f} -> {np.mean(losses[-20:]):.3f}")
    print(f"peak RSS: workers {', '.join(f'{m:.0f}' for m in workers_mib)} MiB; "
          f"PS {', '.join(f'{m:.0f}' for m in ps_mib)} MiB (tables and Adagrad slots live there)")
    print(f"held-out AUC: {score:.4f}")
    return 0 if score >= args.min_auc else 1


if __name__ == "__main__":
    sys.exit(main())
