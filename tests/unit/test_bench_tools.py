"""bench/run.py's table writer keeps other ids' rows on a subset run; bench/profile.py's sample charging."""

import sys

from bench import profile, run


def _table(path):
    return [line for line in path.read_text().splitlines() if line.startswith("| B")]


def test_a_subset_run_replaces_only_its_own_rows(tmp_path, monkeypatch):
    path = tmp_path / "B.md"
    path.write_text(f"# B\n\n{run.BEGIN}\nMeasured once\n\n| id | what | measured (same run) | target |\n"
                    f"|---|---|---|---|\n| B1 | pull | 3 GB/s | met |\n| B2 | w2 | 500 | NOT met |\n{run.END}\ntail\n")
    monkeypatch.setattr(sys, "argv", ["run.py", "--only", "B2", "--write", str(path)])
    run._write_table(path, [("B2", "w2", "900", "met")], set(run.BENCHES) - {"B2"})
    rows = _table(path)
    assert rows[0] == "| B1 | pull | 3 GB/s | met |"
    assert rows[1].startswith("| B2 | w2; a separate run ") and rows[1].endswith("| 900 | met |")
    assert len(rows) == 2 and path.read_text().endswith(f"{run.END}\ntail\n") and "Measured once" in path.read_text()


def test_a_full_run_rewrites_the_table(tmp_path, monkeypatch):
    path = tmp_path / "B.md"
    path.write_text(f"{run.BEGIN}\n| B1 | old | 1 | x |\n| B99 | a row of another script | 5 | y |\n{run.END}\n")
    monkeypatch.setattr(sys, "argv", ["run.py", "--write", str(path)])
    run._write_table(path, [("B1", "pull", "4", "met")], set())
    assert _table(path) == ["| B1 | pull | 4 | met |", "| B99 | a row of another script | 5 | y |"]  # not run.py's: kept


def test_a_sample_is_charged_to_its_innermost_known_frame():
    text = ("thread (1);run (threading.py:982);train_step (mnist.py:113);push (pscluster/client/client.py:348);"
            "send_frame (pscluster/net/framing.py:61) 7\n"
            "thread (1);run (threading.py:982);mlp_grads (mnist.py:80) 3\nnot a sample\n")
    assert profile.parse_collapsed(text) == {"framing+sockets": 7, "model": 3}
