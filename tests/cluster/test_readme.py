"""The README runs as printed: every python snippet as a program, and the Daemons walkthrough's commands."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.cluster.procs import free_range

pytestmark = pytest.mark.cluster
README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)


def blocks(lang, text=None):
    return [code for kind, code in FENCE.findall(README.read_text() if text is None else text) if kind == lang]


def daemons_section():
    text = README.read_text()
    start = text.index("### Daemons")
    return text[start:text.index("\n## ", start)]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSCLUSTER_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # `pscluster`, `python`
    return {**env, **extra}


# what the fit snippet (0) and the checkpoint snippet (2) print; the modes snippet (1) prints nothing checked
PRINTS = {0: r"-> 0\.0\d+; w = \[0 1 2 3 4 5 6 7 8 9\]", 2: re.escape("[-1.  0.  1.  2.  3.  4.]")}


def test_the_readme_has_the_three_python_snippets_whose_output_is_checked():
    fit, modes, checkpoints = blocks("python")
    assert "true_w" in fit and "checkpoint" in checkpoints


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_snippet_runs_as_printed_and_prints_what_it_says(index, tmp_path):
    code = blocks("python")[index]
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=clean_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr == "", out.stderr  # no warnings at exit: every snippet shuts its coordinator down
    if index in PRINTS:
        assert re.search(PRINTS[index], out.stdout), out.stdout


def test_readme_daemons_walkthrough_runs_as_printed(tmp_path):
    script = "\n".join(blocks("bash", daemons_section()))
    env = clean_env(PORT_BASE=str(free_range(3)), DEMO_DIR=str(tmp_path / "demo"))
    proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None or subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout:
            os.killpg(proc.pid, signal.SIGKILL)  # the script's own process group: its daemons
            proc.wait(timeout=10)
    assert proc.returncode == 0, out
    assert "steps = 300; checkpoint at step 300" in out, out
    assert "steps = 400; checkpoint at step 400" in out, out
    ps1 = next(line for line in out.splitlines()[::-1] if f"127.0.0.1:{int(env['PORT_BASE']) + 2}" in line)
    assert re.search(r"│ up\s+│ \d+\s+│ 300 ", ps1), ps1  # the restarted PS 1 restored step 300


def test_readme_tls_in_three_commands_runs_as_printed(tmp_path):
    text = README.read_text()
    start = text.index("## TLS in three commands")
    script = "\n".join(blocks("bash", text[start:text.index("\n## ", start + 3)]))
    (tmp_path / "token").write_text("readme-tls-token\n")
    env = clean_env(PSCLUSTER_TOKEN_FILE=str(tmp_path / "token"))
    proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        # `pscluster up &` outlives the script: its process group is the script's
        if subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout:
            os.killpg(proc.pid, signal.SIGINT)
            deadline = time.monotonic() + 30
            while subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout:
                if time.monotonic() > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.1)
    assert proc.returncode == 0, out + (tmp_path / "up.log").read_text()
    assert out.count(" up ") >= 2 and "coordinator: " in out, out  # PS tasks and coordinator answered over mutual TLS
    assert "wrote tls/ca.pem" in out
    assert "READY up" in (tmp_path / "up.log").read_text()
