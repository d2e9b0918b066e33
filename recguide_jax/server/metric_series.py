"""The exported series, built at scrape time from `ServerMetrics`' accumulators and the engine's counters: vLLM's
series (`recguide:<vLLM's name>` with a `model_name` label), the engine's own beside them (block-size rounds,
forwards, shared prompt tokens), the decoding strategy's (`Strategy.metrics`) and the deprecated pre-vLLM
`recguide_*` names."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from recguide_jax.server.metric_types import (FINISH_REASONS, FORWARD_KINDS, LEGACY_PREFIX, PREFIX, Histogram,
                                              engine_snapshot)


class Collector:
  """Builds every family at scrape time from ServerMetrics' accumulators and the engine's counters."""

  def __init__(self, metrics):
    self.m = metrics

  def collect(self):
    m = self.m
    et = m.engine_thread
    eng = et.engine
    snap = engine_snapshot(et)
    totals = snap["totals"]
    labels, values = ["model_name"], [m.model_name]
    with m._lock:
      finished = dict(m.finished)
      http_errors = dict(m.http_errors)
      fin_prompt, fin_gen = m.finished_prompt_tokens, m.finished_generation_tokens
      rounds, round_tokens = m._rounds, m._round_tokens

    def gauge(name, doc, value, extra=None):
      g = GaugeMetricFamily(PREFIX + name, doc, labels=labels + list(extra or {}))
      g.add_metric(values + list((extra or {}).values()), value)
      return g

    def counter(name, doc, value):
      c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
      c.add_metric(values, value)
      return c

    def labeled_counter(name, doc, label, items):
      c = CounterMetricFamily(PREFIX + name, doc, labels=labels + [label])
      for key, value in items:
        c.add_metric(values + [str(key)], value)
      return c

    def histogram(name, doc, hist: Histogram, prefix=PREFIX, with_labels=True):
      buckets, total = hist.snapshot()
      h = HistogramMetricFamily(prefix + name, doc, labels=labels if with_labels else None)
      h.add_metric(values if with_labels else [], buckets, total)
      return h

    # ---- vLLM's series ------------------------------------------------------------------------------------------
    yield gauge("num_requests_running", "Number of requests in the running batch.", snap["running"])
    yield gauge("num_requests_waiting", "Number of requests waiting for a batch slot.", snap["waiting"])
    yield gauge("kv_cache_usage_perc", "KV-cache usage: the fraction of KV pages owned by requests (1 = 100%).",
                snap["kv_usage"])
    yield counter("prompt_tokens", "Number of prefill tokens processed.", totals.get("prompt_tokens", 0))
    yield counter("generation_tokens", "Number of generation tokens processed.", totals.get("generated_tokens", 0))
    yield labeled_counter("request_success", "Count of finished requests by finish reason.", "finished_reason",
                          [(r, finished.get(r, 0)) for r in sorted(set(FINISH_REASONS) | set(finished))])
    yield histogram("request_prompt_tokens", "Number of prefill tokens per finished request.", m.prompt_len)
    yield histogram("request_generation_tokens", "Number of generation tokens per finished request.",
                    m.generation_len)
    yield histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft)
    yield histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds (one observation "
                    "per engine update that emits tokens).", m.itl)
    yield histogram("request_time_per_output_token_seconds", "Histogram of time per output token per request in "
                    "seconds (decode time / (output tokens - 1)).", m.tpot)
    yield histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", m.e2e)
    yield histogram("request_queue_time_seconds", "Histogram of time spent waiting for a batch slot in seconds.",
                    m.queue)
    yield histogram("request_inference_time_seconds", "Histogram of time spent in the running batch in seconds.",
                    m.inference)
    yield histogram("request_prefill_time_seconds", "Histogram of time from admission to the first token in "
                    "seconds.", m.prefill)
    yield histogram("request_decode_time_seconds", "Histogram of time from the first token to the last in seconds.",
                    m.decode)
    # speculative decoding: a draft is one verified block of B tokens (the seed and B - 1 draft tokens); accepted
    # tokens are the draft tokens the verifier kept, the bonus/correction token not included (vLLM's convention)
    yield counter("spec_decode_num_drafts", "Number of spec decoding drafts (verified blocks).",
                  totals.get("drafts", 0))
    yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.", totals.get("draft_tokens", 0))
    yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                  totals.get("accepted_draft_tokens", 0))
    per_position = snap["per_position"]  # engine positions count from 1 (the first draft token after the seed)
    positions = max([eng.rc.max_block - 1] + list(per_position))
    yield labeled_counter("spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position (0: the "
                          "first draft token).", "position",
                          [(p, per_position.get(p + 1, 0)) for p in range(positions)])
    # ---- the engine's and the strategy's own series -----------------------------------------------------------
    blocks = dict(snap["block_sizes"])
    strategy = eng.strategy
    try:  # zeros for every block size the strategy may plan (and AR rounds, when it may plan them), so shares exist
      planned = tuple(strategy.block_sizes()) + ((1,) if getattr(strategy, "plans_ar", False) else ())
    except Exception:
      planned = ()
    for b in planned:
      blocks.setdefault(int(b), 0)
    yield labeled_counter("block_size_rounds", "Decode rounds by block size (1: plain AR rounds).", "block_size",
                          sorted(blocks.items()))
    yield counter("prompt_tokens_shared", "Prompt tokens of n > 1 samples taken from another sample's KV pages "
                  "instead of prefilled again.", totals.get("prompt_tokens_shared", 0))
    strategy_metrics = snap["strategy_metrics"]
    for sm in strategy_metrics:
      family = (CounterMetricFamily if sm.kind == "counter" else GaugeMetricFamily)(
          PREFIX + sm.name, sm.doc, labels=labels + ([sm.label] if sm.label else []))
      for key, value in (sm.value if sm.label else [(None, sm.value)]):
        family.add_metric(values + ([str(key)] if sm.label else []), value)
      yield family
    kinds = list(FORWARD_KINDS) + sorted(k[len("forwards_"):] for k in totals
                                         if k.startswith("forwards_") and k[len("forwards_"):] not in FORWARD_KINDS)
    yield labeled_counter("forwards", "Batched device forwards by kind.", "kind",
                          [(k, totals.get(f"forwards_{k}", 0)) for k in kinds])
    yield gauge("kv_cache_pages_used", "KV cache pages owned by requests.", snap["pages_used"])
    yield gauge("kv_cache_pages_total", "Usable KV cache pages.", snap["pages_total"])
    yield gauge("compilations_after_warmup", "Backend compilations since warm-up ended (0 unless a request needed a "
                "variant warm-up did not build: the first one with prompt logprobs).",
                eng.runner.compiles_after_warmup)
    yield labeled_counter("http_errors", "Error answers (bodies and stream error events) by HTTP status.", "code",
                          sorted(http_errors.items()))
    info = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the KV cache and policy.",
                             labels=labels + ["page_size", "num_pages", "max_model_len", "max_num_seqs", "policy"])
    info.add_metric(values + [str(eng.rc.page_size), str(snap["pages_total"]), str(eng.rc.max_model_len),
                              str(eng.rc.max_batch), str(getattr(strategy, "name", ""))], 1.0)
    yield info
    if not m.legacy_names:
      return
    # ---- deprecated names (no labels), as before the vLLM-style series ------------------------------------------
    L = LEGACY_PREFIX

    def legacy(kind, name, doc, value, label=None, items=None):
      fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
          L + name, doc + " Deprecated: see docs/metrics.md.", labels=[label] if label else None)
      if label:
        for k, v in items:
          fam.add_metric([str(k)], v)
      else:
        fam.add_metric([], value)
      return fam

    yield legacy("counter", "requests", "Finished requests by finish reason.", None, "status",
                 [(r, finished.get(r, 0)) for r in sorted(set(FINISH_REASONS) | set(finished))])
    yield legacy("counter", "http_errors", "Error answers by HTTP status.", None, "code", sorted(http_errors.items()))
    yield legacy("counter", "prompt_tokens", "Prompt tokens of finished requests.", fin_prompt)
    yield legacy("counter", "generation_tokens", "Output tokens of finished requests.", fin_gen)
    yield histogram("time_to_first_token_seconds", "Time to first token. Deprecated.", m.legacy_ttft, L, False)
    yield histogram("time_per_output_token_seconds", "Mean time per output token after the first. Deprecated.",
                    m.legacy_tpot, L, False)
    yield histogram("e2e_request_latency_seconds", "End-to-end request latency in the engine. Deprecated.",
                    m.legacy_e2e, L, False)
    if rounds:
      yield legacy("gauge", "mean_acceptance_length", "Tokens emitted per decode round, over all finished requests.",
                   round_tokens / rounds)
    yield legacy("gauge", "queue_depth", "Requests waiting for a batch slot.", snap["waiting"])
    yield legacy("gauge", "running_requests", "Requests in the running batch.", snap["running"])
    yield legacy("gauge", "kv_pages_in_use", "KV cache pages owned by requests.", snap["pages_used"])
    yield legacy("gauge", "kv_pages_total", "Usable KV cache pages.", snap["pages_total"])
    yield legacy("gauge", "compilations_after_warmup", "Backend compilations since warm-up ended.",
                 eng.runner.compiles_after_warmup)
    yield legacy("counter", "forwards", "Batched device forwards by kind.", None, "kind",
                 [(k, totals.get(f"forwards_{k}", 0)) for k in kinds])
    yield legacy("counter", "draft_tokens", "Draft tokens offered to the verifier.", totals.get("draft_tokens", 0))
    yield legacy("counter", "accepted_draft_tokens", "Draft tokens the verifier accepted.",
                 totals.get("accepted_draft_tokens", 0))
    yield legacy("counter", "accepted_tokens_per_position", "Accepted draft tokens by position (from 1).", None,
                 "position", sorted(per_position.items()))
    yield legacy("counter", "block_size_choices", "Decode rounds by block size.", None, "block_size",
                 sorted(snap["block_sizes"].items()))
    for sm in strategy_metrics:
      if sm.legacy:
        yield legacy(sm.kind, sm.name, sm.doc, sm.value)
