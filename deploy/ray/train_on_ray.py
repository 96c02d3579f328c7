"""Train the MNIST MLP on a Ray cluster: `python deploy/ray/train_on_ray.py --address auto`.

PS tasks and workers run as Ray actors (pscluster.ops.ray_launcher.RayCluster); the coordinator runs here,
in the driver. For a multi-node cluster pass --host with an address every node can reach and a
--checkpoint-dir on storage every node mounts.
"""

import argparse
import importlib.util
import os
import pathlib
import tempfile

import numpy as np

import pscluster as ps

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("mnist_example", ROOT / "examples" / "mnist.py")
mnist = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mnist)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", default=None, help="Ray address (default: a local runtime)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    if args.address is None and args.host.startswith("127."):
        # Ray reads this once, at import: the addresses it derives for this machine are then loopback,
        # so its GCS, raylet, agents and workers listen on --host only (by default they bind every interface)
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    from pscluster.ops.ray_launcher import RayCluster

    if args.address is None:  # a local runtime: every Ray component on --host (loopback by default), no dashboard
        ray.init(_node_ip_address=args.host, include_dashboard=False)
    else:
        ray.init(address=args.address)
    x, y, xt, yt = mnist.load_mnist()
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(f"{tmp}/train.npz", x=x, y=y)
        cluster = RayCluster(2, 2, host=args.host, checkpoint_dir=args.checkpoint_dir).start()
        coord = ps.ClusterCoordinator(cluster.settings(), ps_resolver=cluster.resolver)
        try:
            coord.wait_for_workers(2)
            params = mnist.create_params(coord)
            mnist.train(coord, params, mnist.make_dataset(coord, f"{tmp}/train.npz", 64), args.steps, 1)
            print(f"held-out accuracy: {mnist.accuracy(ps.pull(params), xt, yt):.4f}")
        finally:
            coord.shutdown()
            cluster.stop()
