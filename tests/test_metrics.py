"""/metrics under vLLM's names: the in-process app over the bundled model (LinearSS, so drafts are really accepted)
serves a few requests over HTTP; the scrape, parsed with prometheus_client's parser, must hold every vLLM-named
series with the model_name label, no `_created` series, and counts that follow exactly from the responses'
`speculation` fields (how the engine records acceptance: a verify round of block B offers B - 1 draft tokens and
keeps `accepted_length - 1` of them, the accepted ones being a prefix of the draft). Also the periodic stats line."""

import asyncio
import json
import logging
import os
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import server_fixtures as sf  # noqa: E402

MODEL = "nld-metrics"
BLOCK = 8
PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
           "clips did Natalia sell altogether in April and May?",
           "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did "
           "she earn?",
           "Betty is saving money for a new wallet which costs $100. How much more money does Betty need?"]

VLLM_SERIES = {  # family name -> type
    "recguide:num_requests_running": "gauge", "recguide:num_requests_waiting": "gauge",
    "recguide:kv_cache_usage_perc": "gauge", "recguide:prompt_tokens": "counter",
    "recguide:generation_tokens": "counter", "recguide:request_success": "counter",
    "recguide:time_to_first_token_seconds": "histogram", "recguide:inter_token_latency_seconds": "histogram",
    "recguide:e2e_request_latency_seconds": "histogram", "recguide:request_queue_time_seconds": "histogram",
    "recguide:request_time_per_output_token_seconds": "histogram",
    "recguide:request_prompt_tokens": "histogram", "recguide:request_generation_tokens": "histogram",
    "recguide:spec_decode_num_drafts": "counter", "recguide:spec_decode_num_draft_tokens": "counter",
    "recguide:spec_decode_num_accepted_tokens": "counter",
    "recguide:spec_decode_num_accepted_tokens_per_pos": "counter", "recguide:block_size_rounds": "counter",
}


@pytest.fixture(scope="module")
def served():
  from recguide_jax import LLM
  from recguide_jax.engine.thread import EngineThread
  from recguide_jax.server.app import create_app
  # max_batch 1: one batch bucket to compile; concurrent requests wait their turn (queue time is observed)
  llm = LLM(policy="linear", block_size=BLOCK, max_num_seqs=1, max_model_len=256, page_size=16, warmup=False,
            compile_cache_dir=None)
  thread = EngineThread(llm.engine).start()
  app = create_app(thread, llm.tokenizer, MODEL, log_stats_interval_s=0)
  server = sf.InProcessServer(app)
  yield server, app, thread
  server.stop()


def scrape(base):
  text = httpx.get(base + "/metrics", timeout=30).text
  families = {f.name: f for f in text_string_to_metric_families(text)}
  samples = {(s.name, frozenset(s.labels.items())): s.value for f in families.values() for s in f.samples}
  return text, families, samples


def test_vllm_named_metrics_agree_with_responses(served):
  server, app, _ = served
  base = server.base

  async def run():
    async with httpx.AsyncClient(base_url=base, timeout=120) as h:
      async def plain(p, n):
        r = await h.post("/v1/completions", json={"prompt": p, "max_tokens": n, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

      async def streamed(p, n):
        body = {"messages": [{"role": "user", "content": p}], "max_tokens": n, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        usage = spec = None
        async with h.stream("POST", "/v1/chat/completions", json=body) as r:
          assert r.status_code == 200
          async for line in r.aiter_lines():
            if line.startswith("data: {"):
              ev = json.loads(line[6:])
              if ev.get("usage"):
                usage, spec = ev["usage"], ev["speculation"]
        return {"usage": usage, "speculation": spec}

      # all at once: with max_batch 1 three of them wait for the batch slot
      return await asyncio.gather(plain(PROMPTS[0], 40), plain(PROMPTS[1], 24), streamed(PROMPTS[2], 32),
                                  plain(PROMPTS[0][:40], 16))

  answers = asyncio.run(run())
  text, families, snap = scrape(base)
  label = ("model_name", MODEL)

  # every vLLM-named series is there, typed like vLLM's, with the model_name label; no _created series anywhere
  assert "_created" not in text
  for name, kind in VLLM_SERIES.items():
    assert name in families, name
    assert families[name].type == kind, (name, families[name].type)
    assert families[name].samples and all(s.labels.get("model_name") == MODEL for s in families[name].samples), name

  def v(name, **labels):
    return snap.get((name, frozenset({label, *labels.items()})), 0.0)

  specs = [a["speculation"] for a in answers]
  lengths = [a for s in specs for a in s["accepted_lengths"]]  # tokens per round, the bonus token included
  assert all(b == BLOCK for s in specs for b in s["block_sizes"])
  # a draft is one verified block; B - 1 draft tokens each; accepted tokens exclude the bonus token
  assert v("recguide:spec_decode_num_drafts_total") == len(lengths) == sum(s["rounds"] for s in specs)
  assert v("recguide:spec_decode_num_draft_tokens_total") == (BLOCK - 1) * len(lengths)
  accepted = sum(a - 1 for a in lengths)
  assert accepted > 0  # the bundled model's drafts are accepted: the per-position checks below are not vacuous
  assert v("recguide:spec_decode_num_accepted_tokens_total") == accepted == sum(s["accepted_draft_tokens"]
                                                                                for s in specs)
  per_pos = [v("recguide:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(BLOCK - 1)]
  # accepted drafts are a prefix: position p counts the rounds that kept more than p draft tokens
  assert per_pos == [sum(a - 1 > p for a in lengths) for p in range(BLOCK - 1)]
  assert per_pos[0] == sum(a >= 2 for a in lengths)
  assert all(x >= y for x, y in zip(per_pos, per_pos[1:])) and sum(per_pos) == accepted
  # tokens and requests
  assert v("recguide:prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers)
  assert v("recguide:generation_tokens_total") == sum(a["usage"]["completion_tokens"] for a in answers)
  finished = {r: v("recguide:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")}
  assert sum(finished.values()) == len(answers) and finished["error"] == finished["abort"] == 0
  for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
               "request_prompt_tokens", "request_generation_tokens"):
    assert v(f"recguide:{name}_count") == len(answers), name
  assert v("recguide:request_queue_time_seconds_sum") > 0  # requests queued behind the first
  # one inter-token latency per decode round (each round's tokens reach the client together)
  assert v("recguide:inter_token_latency_seconds_count") == len(lengths)
  assert v("recguide:inter_token_latency_seconds_bucket", le="+Inf") == len(lengths)
  assert v("recguide:request_generation_tokens_sum") == sum(a["usage"]["completion_tokens"] for a in answers)
  # the engine's own series: every round was a block of BLOCK; RecGuide's series come from its strategy only
  assert v("recguide:block_size_rounds_total", block_size=str(BLOCK)) == len(lengths)
  assert not any(name.startswith(("recguide:overlap", "recguide:regime")) for name, _ in snap)
  # idle now: nothing running or waiting, no KV page owned
  assert v("recguide:num_requests_running") == 0 and v("recguide:num_requests_waiting") == 0
  assert v("recguide:kv_cache_usage_perc") == 0
  assert v("recguide:spec_decode_num_accepted_tokens_total") == accepted
  assert not any(name.startswith("recguide_") for name, _ in snap)  # one name per series: no pre-vLLM aliases


def test_kv_cache_usage_is_a_fraction(served):
  """kv_cache_usage_perc is pages owned / usable pages (vLLM's fraction), not a page count: pages are taken by hand
  while the engine is idle (no request can run meanwhile: nothing is submitted)."""
  server, app, thread = served
  alloc = thread.engine.allocator
  key = ("recguide:kv_cache_usage_perc", frozenset({("model_name", MODEL)}))
  assert scrape(server.base)[2][key] == 0
  alloc.add("held-by-test")
  try:
    alloc.reserve("held-by-test", 3 * alloc.page_size)
    assert alloc.num_used == 3
    _, _, snap = scrape(server.base)
    assert snap[key] == pytest.approx(3 / (alloc.num_pages - 1))
    assert snap[("recguide:kv_cache_pages_used", frozenset({("model_name", MODEL)}))] == 3
  finally:
    alloc.free("held-by-test")
  assert scrape(server.base)[2][key] == 0


def test_stats_line(served, caplog):
  """The periodic line: vLLM's fields, with the interval's throughput and acceptance; nothing when idle."""
  from recguide_jax.server.stats_log import StatsLogger
  server, app, thread = served
  stats = StatsLogger(thread, interval_s=0)  # driven by hand here; interval 0: no thread
  assert stats.start()._thread is None
  assert stats.line() is None  # idle since it was made
  eng = thread.engine
  before = dict(eng.totals)
  r = httpx.post(server.base + "/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 30, "temperature": 0},
                 timeout=120)
  assert r.status_code == 200
  # the response leaves once the request is recorded; the engine thread ends its step (and drops the request from
  # `running`) right after, so wait for that before reading the line
  for _ in range(1000):
    if not eng.running and not eng.waiting:
      break
    time.sleep(0.01)
  with caplog.at_level(logging.INFO, logger="recguide_jax.server"):
    line = stats.log_once()
  assert line is not None and line in caplog.text
  for field in ("Avg prompt throughput:", "tokens/s, Avg generation throughput:", "Running: 0 reqs",
                "Waiting: 0 reqs", "KV cache usage: 0.0%", "Mean acceptance length:"):
    assert field in line, (field, line)
  drafts = eng.totals["drafts"] - before.get("drafts", 0)
  acc = eng.totals["accepted_draft_tokens"] - before.get("accepted_draft_tokens", 0)
  assert f"Mean acceptance length: {1 + acc / drafts:.2f}" in line
  # one more line shows the drop to zero after the activity, then idle intervals log nothing
  assert stats.line().startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s")
  assert stats.line() is None


def test_stats_thread_logs_while_active(served, caplog):
  from recguide_jax.server.stats_log import StatsLogger
  server, app, thread = served
  stats = StatsLogger(thread, interval_s=0.05)
  with caplog.at_level(logging.INFO, logger="recguide_jax.server"):
    stats.start()
    try:
      r = httpx.post(server.base + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 64,
                                                            "temperature": 0, "ignore_eos": True}, timeout=120)
      assert r.status_code == 200
      stats._stop.wait(0.3)  # at least one interval after the request
    finally:
      stats.stop()
  lines = [rec.getMessage() for rec in caplog.records if "Avg generation throughput" in rec.getMessage()]
  assert lines, caplog.text


def test_the_batched_inter_token_histogram_exports_what_prometheus_clients_would():
  """`BatchedHistogram` (counted in batches, folded at every read and every FOLD_AT observations) against
  prometheus_client's Histogram on the same values, bucket bounds themselves included."""
  import numpy as np
  from prometheus_client import Histogram

  from recguide_jax.server.metric_types import ITL_BUCKETS, without_created
  from recguide_jax.server.metrics import BatchedHistogram
  values = np.random.default_rng(0).exponential(0.05, 2 * BatchedHistogram.FOLD_AT + 7).tolist()
  values += list(ITL_BUCKETS) + [0.0, 1e3]
  reference = Histogram("recguide:itl", "doc", ["model_name"], buckets=ITL_BUCKETS, registry=None)
  batched = BatchedHistogram("recguide:itl", "doc", ITL_BUCKETS, ["model_name"], ["m"])
  read_midway = None
  for i, v in enumerate(values):
    reference.labels("m").observe(v)
    batched.observe(v)
    if i == 100:
      read_midway = list(without_created(batched))  # a scrape between observations loses none
  assert read_midway[0].samples[-2].value == 101  # _count after 101 observations

  def samples(metric):
    (family,) = without_created(metric)
    return family.name, family.type, family.documentation, [(s.name, s.labels, s.value) for s in family.samples]
  name, kind, doc, want = samples(reference)
  got = samples(batched)
  assert got[:3] == (name, kind, doc)
  assert [s[:2] for s in got[3]] == [s[:2] for s in want]
  np.testing.assert_allclose([s[2] for s in got[3]], [s[2] for s in want], rtol=1e-12)
