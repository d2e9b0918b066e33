"""launch/bench_serving.py's core against a real HTTP server (the in-process app over a tiny random checkpoint): the
report's schema, ordered percentiles, token counts that match the requests, acceptance figures that agree with the
server's /metrics, the plots; and its input checks (loopback only, dataset fields, load levels, arrivals)."""

import importlib.util
import json
import math
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import server_fixtures as sf  # noqa: E402

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def bs():
  spec = importlib.util.spec_from_file_location("bench_serving", sf.REPO / "launch" / "bench_serving.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules["bench_serving"] = mod  # dataclasses look their module up while the class is made
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  from recguide_jax import LLM
  from recguide_jax.engine.thread import EngineThread
  from recguide_jax.server.app import create_app
  ckpt = sf.build_checkpoint(tmp_path_factory.mktemp("bench_serving") / "nld-bench")
  # max_batch 1: one batch bucket to compile (C = 2 then queues one request, as a full server would)
  llm = LLM(ckpt, "linear", 8, max_num_seqs=1, max_model_len=128, page_size=8, warmup=False, compile_cache_dir=None)
  app = create_app(EngineThread(llm.engine).start(), llm.tokenizer, "nld-bench", log_stats_interval_s=0)
  srv = sf.InProcessServer(app)
  yield srv
  srv.stop()


def test_report_against_a_live_server(bs, server, tmp_path):
  data = tmp_path / "prompts.jsonl"
  rows = [{"question": "How many clips did Natalia sell?"}, {"prompt": "Hello world"}, {"question": "What is 2 + 2?"},
          {"prompt": "The quick brown fox"}]
  data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  prompts = bs.load_prompts(str(data), 4)
  assert prompts == ["How many clips did Natalia sell?", "Hello world", "What is 2 + 2?", "The quick brown fox"]
  levels = bs.make_levels("concurrency", [1, 2])
  run = bs.run_benchmark(server.base, prompts, levels, label="linear", max_tokens=MAX_TOKENS, ignore_eos=True,
                         num_warmups=1, request_timeout_s=120, max_level_s=300)
  report = {"benchmark": "bench_serving", "version": 1, "date": "-", "machine": "-",
            "config": {"command": "test", "dataset": str(data), "endpoint": "chat", "num_prompts": 4,
                       "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "sweep_over": "concurrency",
                       "sweep": [1, 2]},
            "runs": [run]}
  paths = bs.write_outputs(report, str(tmp_path / "out"), "bench")
  loaded = json.loads(open(paths["json"]).read())
  assert loaded["runs"][0]["model"] == "nld-bench" and len(loaded["plots"]) == 3
  for path in loaded["plots"]:
    assert open(tmp_path / "out" / path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  md = open(paths["md"]).read()
  assert md.count("| linear | C=") == 2

  levels_out = loaded["runs"][0]["levels"]
  assert [lv["name"] for lv in levels_out] == ["C=1", "C=2"] and [lv["concurrency"] for lv in levels_out] == [1, 2]
  for lv in levels_out:
    assert lv["completed"] == 4 and lv["failed"] == 0 and not lv["errors"]
    assert lv["output_tokens"] == 4 * MAX_TOKENS and lv["prompt_tokens"] > 0
    assert lv["duration_s"] > 0 and lv["output_throughput"] == pytest.approx(lv["output_tokens"] / lv["duration_s"])
    assert lv["request_throughput"] == pytest.approx(4 / lv["duration_s"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "per_request_output_tok_s"):
      d = lv[key]
      assert set(d) == {"mean", "p50", "p90", "p99"}, key
      assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
    assert lv["ttft_ms"]["p99"] <= lv["e2e_ms"]["p99"]
    # acceptance from the responses' speculation field: every round a block of 8 (LinearSS)
    hist = {int(k): v for k, v in lv["accepted_length_hist"].items()}
    assert sum(hist.values()) == lv["rounds"] > 0 and all(1 <= k <= 8 for k in hist)
    assert lv["mean_accepted_length"] == pytest.approx(sum(k * v for k, v in hist.items()) / lv["rounds"])
    assert lv["block_size_shares"] == {"8": 1.0}
    # ... and from the server's /metrics over the level (only this client was sending)
    sm = lv["server_metrics"]
    assert sm["spec_decode_num_drafts"] == lv["rounds"]
    assert sm["spec_decode_num_draft_tokens"] == 7 * lv["rounds"]
    assert sm["mean_acceptance_length"] == pytest.approx(lv["mean_accepted_length"])
    assert sm["block_size_rounds"] == {"8": lv["rounds"]}


def test_refuses_what_it_must_not_do(bs, tmp_path):
  for url in ("http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1", "127.0.0.1:8000"):
    with pytest.raises(bs.BenchError, match="base_url"):
      bs.check_loopback(url)
  assert bs.check_loopback("http://127.0.0.2:9/v1/") == "http://127.0.0.2:9"
  assert bs.check_loopback("http://[::1]:80") == "http://[::1]:80"
  assert bs.check_loopback("http://localhost:8000") == "http://localhost:8000"
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "no prompt field"}\n')
  with pytest.raises(bs.BenchError, match="`prompt` or `question`"):
    bs.load_prompts(str(bad), 1)
  bad.write_text('{"prompt": "one"}\n')
  with pytest.raises(bs.BenchError, match="--num_prompts"):
    bs.load_prompts(str(bad), 2)
  with pytest.raises(bs.BenchError, match="--dataset_path"):
    bs.load_prompts(str(tmp_path / "missing.jsonl"), 1)
  for kind, values in (("concurrency", ["0"]), ("concurrency", ["1.5"]), ("concurrency", ["inf"]),
                       ("request_rate", ["-1"]), ("request_rate", ["x"])):
    with pytest.raises(bs.BenchError, match="--sweep"):
      bs.parse_levels(kind, values)
  assert bs.parse_levels("request_rate", ["0.5", "inf"]) == [0.5, math.inf]


def test_arrivals(bs):
  fixed = bs.make_levels("request_rate", [4.0], arrival="fixed")[0]
  assert bs.arrival_offsets(fixed, 3, random.Random(0)) == [0.0, 0.25, 0.5]
  burst = bs.make_levels("request_rate", [math.inf])[0]
  assert bs.arrival_offsets(burst, 3, random.Random(0)) == [0.0, 0.0, 0.0] and burst.name == "rate=inf"
  poisson = bs.make_levels("request_rate", [10.0], concurrency=3)[0]
  assert poisson.concurrency == 3
  t = bs.arrival_offsets(poisson, 4001, random.Random(1))
  gaps = [b - a for a, b in zip(t, t[1:])]
  assert all(g > 0 for g in gaps) and abs(sum(gaps) / len(gaps) - 0.1) < 0.01  # mean 1 / rate
  closed = bs.make_levels("concurrency", [4.0])[0]
  assert closed.name == "C=4" and closed.concurrency == 4 and closed.request_rate == math.inf
