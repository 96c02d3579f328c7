"""The committed gRPC stubs are exactly what `python proto/generate.py` produces."""

import importlib.util
import pathlib

PROTO = pathlib.Path(__file__).resolve().parents[2] / "proto"


def test_generated_stubs_are_up_to_date(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", PROTO / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(tmp_path)
    for name in module.GENERATED:
        assert (tmp_path / name).read_text() == (PROTO / name).read_text(), (
            f"proto/{name} is stale: run `python proto/generate.py`")
