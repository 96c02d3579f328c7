"""The client core: what a worker or a driver uses to reach the PS tasks.

`PSClient` (client.py) pulls and pushes variables through a `TensorTransport` (tensors.py), which it is
handed as a value; `Variable` handles (variables.py) and the closure scope (context.py) sit on top of it;
plans.py and fresh.py are plain functions and values over numpy arrays.

May import: the API modules at the package root, `pscluster.net` and `pscluster.proto`. Never a role
(`pscluster.server`, `.worker`, `.coordinator`) nor `pscluster.ops`.
"""
