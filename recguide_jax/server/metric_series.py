"""The exported series, built at scrape time from `ServerMetrics`' prometheus_client histograms and counters and
the engine's counters: vLLM's series (`recguide:<vLLM's name>` with a `model_name` label), the engine's own beside
them (block-size rounds, forwards, shared prompt tokens), and the decoding strategy's (`Strategy.metrics`). The engine's counters live in the engine, so they are read here as metric
families (prometheus_client's way for values owned elsewhere)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from recguide_jax.server.metric_types import (FORWARD_KINDS, PREFIX, engine_snapshot,
                                              without_created)


class Collector:
  """Builds every family at scrape time from ServerMetrics' metrics and the engine's counters."""

  def __init__(self, metrics):
    self.m = metrics

  def collect(self):
    m = self.m
    et = m.engine_thread
    eng = et.engine
    snap = engine_snapshot(et)
    totals = snap["totals"]
    labels, values = ["model_name"], [m.model_name]

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

    # ---- vLLM's series ------------------------------------------------------------------------------------------
    yield gauge("num_requests_running", "Number of requests in the running batch.", snap["running"])
    yield gauge("num_requests_waiting", "Number of requests waiting for a batch slot.", snap["waiting"])
    yield gauge("kv_cache_usage_perc", "KV-cache usage: the fraction of KV pages owned by requests (1 = 100%).",
                snap["kv_usage"])
    yield counter("prompt_tokens", "Number of prefill tokens processed.", totals.get("prompt_tokens", 0))
    yield counter("generation_tokens", "Number of generation tokens processed.", totals.get("generated_tokens", 0))
    yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                  totals.get("prefix_cache_queries", 0))
    yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                  totals.get("prefix_cache_hits", 0))
    yield from without_created(m.request_success)
    for hist in m.histograms:
      yield from without_created(hist)
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
                "variant warm-up did not build: prompt logprobs, a new sampling-control length).",
                eng.runner.compiles_after_warmup)
    yield from without_created(m.http_errors)
    info = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the KV cache and policy.",
                             labels=labels + ["page_size", "num_pages", "max_model_len", "max_num_seqs", "policy"])
    info.add_metric(values + [str(eng.rc.page_size), str(snap["pages_total"]), str(eng.rc.max_model_len),
                              str(eng.rc.max_batch), str(getattr(strategy, "name", ""))], 1.0)
    yield info
