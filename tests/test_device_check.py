"""launch/device_check.py on the CPU at its tiny shape: the kernel check, greedy AR == LinearSS 16 == RecGuide, the
decode table and the report files (on a GPU/TPU the same script runs NLD-8B shapes)."""

import json
import os
import pathlib
import subprocess
import sys

from conftest import COMPILE_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_device_check_tiny_on_cpu(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(ROOT / "launch" / "device_check.py"), "--shape=tiny", "--concurrency=1",
       "--max_tokens=4", "--num_prompts=1", "--prompt_len=16", f"--output_dir={tmp_path}"],
      cwd=ROOT, env=dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {COMPILE_FLAGS}".strip()),
      capture_output=True, text=True, timeout=1500)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((tmp_path / "device_check.json").read_text())
  assert report["platform"] == "cpu"
  assert report["kernels"]["ok"] and report["kernels"]["interpret"]
  assert set(report["kernels"]["max_abs_err"]) == {"causal", "full", "tree"}
  assert report["lossless"] == {"linear": True, "recguide": True}
  assert report["divergence"] == {"linear": [], "recguide": []} and report["tie_margin"] == 0.0  # float32: exact
  assert 0 < report["decisive_share"] <= 1
  assert [r["concurrency"] for r in report["decode"]] == [1]
  assert report["decode"][0]["tokens_per_s"] > 0 and 0 < report["decode"][0]["roofline_fraction"]
  assert report["compiles_during_timed_decode"] == 0
  assert (tmp_path / "device_check.md").read_text().startswith("# device_check")


def test_device_check_flag_error_names_the_flag(tmp_path):
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "device_check.py"), "--shape=huge"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "shape" in proc.stderr
