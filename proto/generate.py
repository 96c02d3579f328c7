"""Regenerate the gRPC stubs from pscluster.proto: `python proto/generate.py`.

The proto is compiled through the virtual include path `pscluster/proto=<this folder>`, so the
generated modules import each other as `pscluster.proto.*` instead of protoc's flat `import x_pb2`.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
GENERATED = ("pscluster_pb2.py", "pscluster_pb2.pyi", "pscluster_pb2_grpc.py", "pscluster_pb2_grpc.pyi")


def _plugin(name: str) -> str:
    path = pathlib.Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: pip install mypy-protobuf (in the dev extra)")
    return found


def generate(out_dir: pathlib.Path) -> None:
    """Compile pscluster.proto into out_dir."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-Ipscluster/proto={HERE}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            # typed stubs of both modules (mypy-protobuf, a dev dependency), so `make lint` checks callers
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--mypy_out={tmp}",
            f"--mypy_grpc_out={tmp}",
            "pscluster/proto/pscluster.proto",
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for name in GENERATED:
            shutil.copyfile(pathlib.Path(tmp, "pscluster", "proto", name), out_dir / name)


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
