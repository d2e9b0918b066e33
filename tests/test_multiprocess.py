"""A real multi-process run: two local processes on the CPU backend, 4 devices each, joined by jax.distributed into
one 8-device tp mesh (tests/multihost_worker.py). Process 0 leads (engine, publishes each step), process 1 follows
(runs the same compiled steps with the same inputs); one greedy LinearSS request gives the tokens of one device."""

import json
import os
import socket
import subprocess
import sys

from conftest import COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_serve_one_request_like_one_device(tmp_path):
  port, out = _free_port(), tmp_path / "tokens.json"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["XLA_FLAGS"] = COMPILE_FLAGS  # the session's compile options; each worker adds its device count
  worker = os.path.join(REPO, "tests", "multihost_worker.py")
  procs = [subprocess.Popen([sys.executable, worker, str(pid), str(port), str(out)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in (1, 0)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=1200)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
  result = json.loads(out.read_text())
  assert len(result["tokens"]) == 12
  assert result["tokens"] == result["one_device"]
  assert result["steps"] > 2  # prefill, drafts and verifies all went through the leader's channel
  assert "follower ran" in logs[0]
