"""Benchmark helpers: pricing a forward ledger with a profile, and the paired tau comparison of the model card."""

import numpy as np
import pytest

from recguide_jax import benchmarks as bench
from recguide_jax.recguide.profile import HardwareProfile


def test_priced_ms_charges_each_forward_by_kind_and_batch():
  prof = HardwareProfile({1: {8: 10.0, 16: 12.0}, 4: {8: 20.0, 16: 24.0}}, draft_ms={1: {8: 4.0, 16: 5.0},
                                                                                     4: {8: 8.0, 16: 10.0}},
                         verify_ms={1: {8: 6.0, 16: 7.0}, 4: {8: 12.0, 16: 14.0}}, ar_step_ms={1: 2.0, 4: 3.0},
                         fused_ms={1: {8: 9.0, 16: 13.0}, 4: {8: 18.0, 16: 26.0}})
  log = [("prefill", 64, 1), ("draft", 8, 1), ("verify", 8, 4), ("gverify", 16, 1), ("decode", 1, 4),
         ("fused3", 16, 1), ("fused5", 16, 1)]
  want = 4.0 + 12.0 + 7.0 + 3.0 + 13.0 + (7.0 + (13.0 - 7.0) * 5 / 3)  # prefill is not decode time
  assert bench.priced_ms(log, prof) == pytest.approx(want)
  assert bench.priced_ms([("draft", 8, 2)], prof) == pytest.approx(4.0 + 4.0 / 3)  # interpolated in C


def test_unverified_drafts_count_what_truncated_verifies_left_out():
  # 2 drafting rows at 8 + 16 tokens and 1 AR row: an untruncated verify runs 25 tokens
  log = [("prefill", 64, 3), ("ragged_draft", 24, 2), ("ragged_verify", 25, 3), ("decode", 1, 3),
         ("ragged_draft", 16, 2), ("ragged_verify", 11, 2)]
  assert bench.unverified_drafts(log) == 5
  assert bench.unverified_drafts(log[:4]) == 0


def test_overlap_reuse_reads_table_3_off_the_branch_outcomes():
  from recguide_jax.benchmarks import report
  t = report.overlap_reuse({"correction_hit": 30, "correction_miss": 10, "no_hit": 60, "continuation_hit": 3,
                            "continuation_miss": 1, "continuation_absent": 6})
  assert (t["rounds"], t["rejected_rounds"], t["full_rounds"]) == (110, 100, 10)
  assert (t["correction_coverage"], t["correction_reuse"]) == (0.4, 0.3)
  assert (t["continuation_coverage"], t["continuation_reuse"]) == (0.4, 0.3)
  assert t["saved_draft_share"] == pytest.approx(33 / 110)
  lines = report.overlap_reuse_table([("a", {"no_hit": 2}), ("none", {})])
  assert len(lines) == 3 and lines[2].startswith("| a | 2 | 2 / 0 | 0.0% | 0.0% | - | - | 0.0% |")


def test_paired_tau_gain_is_pooled_and_bootstrapped_over_prompts():
  rng = np.random.default_rng(0)
  small = [(int(n) * 4, int(n)) for n in rng.integers(5, 30, 50)]  # tau 4 on every prompt
  large = [(a + r // 2, r) for a, r in small]  # +0.5 per round on every prompt
  gain = bench.paired_tau_gain({8: small, 32: large}, 8, 32)
  assert gain["prompts"] == 50
  assert gain["diff"] == pytest.approx(sum(a for a, _ in large) / sum(r for _, r in large) - 4.0)
  assert gain["ci95"][0] <= gain["diff"] <= gain["ci95"][1] and gain["ci95"][0] > 0.4
  same = bench.paired_tau_gain({8: small, 32: small}, 8, 32)
  assert same["diff"] == 0.0 and same["ci95"] == [0.0, 0.0]
  noisy = [(a + int(rng.integers(-3 * r, 3 * r)), r) for a, r in small]  # no real gain: the interval covers 0
  wide = bench.paired_tau_gain({8: small, 32: noisy}, 8, 32)
  assert wide["ci95"][0] < 0 < wide["ci95"][1]


def test_paired_ratio_interval_separates_a_real_gap_from_noise():
  rng = np.random.default_rng(1)
  base = 3.0 * np.exp(rng.normal(0, 0.15, 9))  # a drifting machine: +-15% from repeat to repeat
  faster = bench.paired_ratio_interval(base / 1.1 * np.exp(rng.normal(0, 0.01, 9)), base)  # 10% faster, paired
  assert faster["verdict"] == "ahead" and faster["ci95"][0] > 1.05 and faster["repeats"] == 9
  assert faster["ci95"][0] <= faster["geomean"] <= faster["ci95"][1]
  slower = bench.paired_ratio_interval(base * 1.1, base)
  assert slower["verdict"] == "behind" and slower["geomean"] == pytest.approx(1 / 1.1)
  noise = bench.paired_ratio_interval(3.0 * np.exp(rng.normal(0, 0.15, 9)), base)  # same work, unpaired noise
  assert noise["verdict"] == "tie" and noise["ci95"][0] < 1 < noise["ci95"][1]
  with pytest.raises(ValueError, match="one baseline wall time per repeat"):
    bench.paired_ratio_interval([1.0, 2.0], [1.0])
  # pooled over levels: small per-level gaps that no single level resolves add up; each level weighs the same
  walls = [3.0 * np.exp(rng.normal(0, 0.05, 9)) for _ in range(6)]
  levels = [(w * 1.03, w * np.exp(rng.normal(0, 0.03, 9))) for w in walls]  # 3% slower everywhere, 3% noise
  per_level = [bench.paired_ratio_interval(t, b) for t, b in levels]
  pooled = bench.pooled_ratio_interval(levels)
  assert pooled["verdict"] == "behind" and pooled["repeats"] == 54
  assert pooled["geomean"] == pytest.approx(np.exp(np.mean([np.log(p["geomean"]) for p in per_level])))
  assert pooled["ci95"][1] - pooled["ci95"][0] < min(p["ci95"][1] - p["ci95"][0] for p in per_level)
  assert bench.pooled_ratio_interval([([2.0, 3.0], [2.0, 3.0])])["verdict"] == "tie"
  with pytest.raises(ValueError):
    bench.pooled_ratio_interval([])


def test_split_sequential_ledger_cuts_at_each_requests_prefill():
  log = [("prefill", 256, 1), ("prefill", 64, 1), ("draft", 16, 1), ("fused4", 16, 1), ("prefill", 64, 1),
         ("verify", 16, 1), ("decode", 1, 1)]
  parts = bench.split_sequential_ledger(log)
  assert parts == [log[:4], log[4:]]
  assert sum(bench.ledger_counts(p)["forwards"] for p in parts) == bench.ledger_counts(log)["forwards"]
  with pytest.raises(ValueError, match="one after another"):  # two requests in one forward: no per-request cut
    bench.split_sequential_ledger([("prefill", 64, 1), ("verify", 16, 2)])
  with pytest.raises(ValueError, match="start with a prefill"):
    bench.split_sequential_ledger([("draft", 16, 1)])


def test_paired_rate_ratio_is_the_pooled_ratio_with_a_prompt_bootstrap():
  rng = np.random.default_rng(0)
  ms = rng.uniform(50, 150, 40)
  tokens = rng.integers(60, 128, 40).astype(float)
  base = list(zip(tokens, ms))
  faster = list(zip(tokens, ms / 1.2 * rng.uniform(0.9, 1.1, 40)))  # ~1.2x on every prompt, with spread
  out = bench.paired_rate_ratio(faster, base)
  want = (tokens.sum() / sum(m for _, m in faster)) / (tokens.sum() / ms.sum())
  assert out["ratio"] == pytest.approx(want) and out["prompts"] == 40
  lo, hi = out["ci95"]
  assert lo < want < hi and lo > 1.1 and hi < 1.3 and hi - lo > 0.005
  assert bench.paired_rate_ratio(base, base)["ci95"] == pytest.approx([1.0, 1.0])
  with pytest.raises(ValueError):
    bench.paired_rate_ratio(base, base[:-1])


def test_paired_wall_ratios_pair_each_repeat_with_its_best_baseline():
  ratios = bench.paired_wall_ratios([2.0, 4.0, 3.0], {"ar": [2.2, 4.0, 3.3], "linear B=8": [1.9, 5.0, 3.6]})
  assert ratios == pytest.approx([1.9 / 2.0, 4.0 / 4.0, 3.3 / 3.0])
  with pytest.raises(ValueError, match="one wall time per repeat"):
    bench.paired_wall_ratios([2.0, 4.0], {"ar": [2.0]})
  with pytest.raises(ValueError):
    bench.paired_wall_ratios([2.0], {})


def test_bench_recguide_steady_mode_bookkeeping(tmp_path):
  """launch/bench_recguide.py --mode=steady on the bundled model at C = 2 (8 requests: two cohorts of C and more):
  every run's window holds exactly C requests in flight (as the driver counts them and as the engine ran them),
  the tokens counted step by step equal the tokens generated, greedy outputs are equal across policies, and the
  per-level and pooled paired intervals are filled in. Timings are not checked."""
  import json
  import os
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  data = tmp_path / "test.jsonl"
  data.write_text("".join(json.dumps({"question": q, "answer": "-"}) + "\n" for q in (
      "Ann has 5 apples and buys 7 more. How many apples does she have?",
      "A pen costs $3. How much do 4 pens cost?", "Tom walks 3 miles a day. How far does he walk in a week?")))
  proc = subprocess.run([sys.executable, "launch/bench_recguide.py", "--mode=steady", f"--data={data}",
                         "--num_prompts=3", "--steady_requests_per_slot=4", "--max_tokens=16", "--concurrency=2",
                         "--repeats=2", "--profile=docs/profile_cpu.json", f"--output_dir={tmp_path}"],
                        cwd=root, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  res = json.loads((tmp_path / "bench_recguide_steady.json").read_text())
  rows = {r["policy"]: r for r in res["results"]}
  # --ablations (the default) adds RecGuide without first measurements of never-run regimes
  assert set(rows) == {"ar", "linear B=8", "linear B=16", "linear B=32", "recguide", "recguide, no first measurements"}
  for r in rows.values():
    assert r["concurrency"] == 2 and r["requests"] == 8 and r["lossless"], r["policy"]
    assert r["window_in_flight"] == [2, 2] and r["engine_in_flight"] in ([2, 2], None), r["policy"]
    assert r["tokens_counted"] == r["tokens_generated"] and len(r["tokens_counted"]) == 2
    assert 0 < r["window_token_share"] < 1 and r["window_steps"] >= 1 and r["held_tokens_per_s"] > 0
    assert all(0 < t <= g for t, g in zip(r["window_tokens_all"], r["tokens_generated"]))
  assert rows["linear B=32"]["official_fixed_b"] and not rows["linear B=16"]["official_fixed_b"]
  (level,) = res["levels"]
  assert level["fastest_baseline"] in ("ar", "linear B=8", "linear B=16", "linear B=32")
  for iv in (level["interval"], level["vs_official_interval"], res["pooled"]):
    assert iv["ci95"][0] <= iv["geomean"] <= iv["ci95"][1] and iv["repeats"] == 2
  assert res["meta"]["compiles_after_warmup"] == 0
  assert res["meta"]["cpu_model"] and res["meta"]["decode_steps"] == 4 and res["meta"]["jax_backend"] == "cpu"
  md = (tmp_path / "bench_recguide_steady.md").read_text()
  assert "| 2 | recguide |" in md and "pooled over 1 levels" in md


def test_every_report_keeps_the_hand_written_notes_below_its_table(tmp_path):
  """`write_report` replaces a report's table and keeps what was written by hand below its notes mark."""
  from recguide_jax.benchmarks.report import NOTES_MARK, write_report
  _, md = write_report({"x": 1}, "| a |\n", tmp_path, "bench_x")
  assert open(md).read() == "| a |\n"
  with open(md, "a") as f:
    f.write(f"\n{NOTES_MARK}\n## Notes\n\nkept by hand\n")
  write_report({"x": 2}, "| b |\n", tmp_path, "bench_x")
  assert open(md).read() == f"| b |\n\n{NOTES_MARK}\n## Notes\n\nkept by hand\n"


def test_bench_recguide_set_report_keeps_the_hand_written_notes(tmp_path):
  """launch/bench_recguide.py --report_from rewrites a set-mode report from its JSON (the shipped one) and keeps what
  was written by hand below the notes mark of the report it replaces."""
  import os
  import pathlib
  import shutil
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  shutil.copy(root / "docs" / "bench_recguide.json", tmp_path / "run.json")
  mark = "<!-- notes: written by hand, kept when the tables above are regenerated -->"
  (tmp_path / "bench_recguide.md").write_text(f"an old table\n\n{mark}\n## Notes\n\nkept by hand\n")
  proc = subprocess.run([sys.executable, "launch/bench_recguide.py", f"--report_from={tmp_path / 'run.json'}",
                         f"--output_dir={tmp_path}"], cwd=root, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  md = (tmp_path / "bench_recguide.md").read_text()
  assert "an old table" not in md and "| C | policy |" in md
  assert md.endswith(f"{mark}\n## Notes\n\nkept by hand\n") and md.count(mark) == 1
