"""Time to first token with and without automatic prefix caching, on a shared-system-prompt workload.

Every request is one system prompt (`--system_tokens` tokens: GSM8K train examples as few-shot text when the
checkpoint has a tokenizer, else random token ids) followed by its own question (a GSM8K test question, else
`--question_tokens` random ids). One engine serves both settings: the prefix cache is switched on and off between
runs (`PageAllocator.enable_prefix_caching`) and reset before each, so both use the same compiled variants. Each
repeat runs the prompts one after another (`--concurrency 1`, TTFT is then the prefill's own time) or
`--concurrency` at a time, off then on (the order alternates per repeat, so a slow spell of the machine hits both
sides of a pair); the first request of an "on" run fills the cache, the others hit it. Reported: median TTFT per
setting over every request and over the requests after the first, the ratio off / on per repeat with a 95% bootstrap
interval over repeats, the prefix cache's hit rate, and whether the greedy outputs of the two settings agree.

  python launch/bench_prefix_cache.py                      # bundled model -> runs/bench_prefix_cache/
  python launch/bench_prefix_cache.py --output_dir docs    # docs/bench_prefix_cache.{json,md}
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)


def _define_flags():
  from absl import flags

  from recguide_jax.benchmarks import cli
  cli.define_model_flags(max_model_len=2048)
  cli.define_gsm8k_dir_flag()
  flags.DEFINE_integer("system_tokens", 1024, "Tokens of the system prompt every request starts with.")
  flags.DEFINE_integer("question_tokens", 32, "Tokens of each request's own question (random prompts only).")
  flags.DEFINE_integer("num_prompts", 12, "Requests per run.")
  flags.DEFINE_integer("max_tokens", 4, "New tokens per request (greedy).")
  flags.DEFINE_integer("repeats", 3, "Runs per setting (interleaved off / on).")
  flags.DEFINE_integer("concurrency", 1, "Requests in flight at once (1: one after another).")
  flags.DEFINE_string("policy", "ar", "Decoding policy (ar, linear, recguide, diffusion).")
  flags.DEFINE_integer("page_size", 16, "KV page size (the prefix cache shares whole pages).")
  flags.DEFINE_integer("prefill_chunk", 64, "Prompt tokens per prefill forward.")
  flags.DEFINE_enum("prompt_source", "auto", ["auto", "random", "gsm8k"],
                    "auto: GSM8K text when the checkpoint has a tokenizer and the data is there, else random ids.")
  flags.DEFINE_integer("seed", 0, "Seed of the random prompts.")
  cli.define_output_flags("bench_prefix_cache")


def build_prompts(tokenizer, source: str, gsm8k_dir: str, system_tokens: int, question_tokens: int, n: int,
                  vocab: int, seed: int) -> tuple[list[list[int]], str]:
  import numpy as np
  train, test = (os.path.join(gsm8k_dir, f"{s}.jsonl") for s in ("train", "test"))
  use_text = tokenizer is not None and os.path.exists(train) and os.path.exists(test)
  if source == "gsm8k" and not use_text:
    sys.exit(f"error: --prompt_source gsm8k needs a tokenizer and {train}, {test}")
  if source != "random" and use_text:
    with open(train) as f:
      shots = [json.loads(line) for line in f]
    text, k = "", 0
    while len(tokenizer.encode(text)) < system_tokens:
      text += f"Question: {shots[k]['question']}\nAnswer: {shots[k]['answer']}\n\n"
      k += 1
    system = tokenizer.encode(text)[:system_tokens]
    with open(test) as f:
      questions = [json.loads(line)["question"] for line, _ in zip(f, range(n))]
    return [system + tokenizer.encode(f"Question: {q}\nAnswer:") for q in questions], "gsm8k"
  rng = np.random.default_rng(seed)
  system = [int(t) for t in rng.integers(4, vocab, system_tokens)]
  return [system + [int(t) for t in rng.integers(4, vocab, question_tokens)] for _ in range(n)], "random"


def run_once(llm, prompts, params, concurrency: int, cached: bool) -> dict:
  alloc = llm.engine.allocator
  alloc.reset_prefix_cache()
  alloc.enable_prefix_caching = cached
  totals = llm.engine.totals
  queries, hits = totals["prefix_cache_queries"], totals["prefix_cache_hits"]
  outs = []
  t0 = time.perf_counter()
  for i in range(0, len(prompts), concurrency):
    outs += llm.generate(prompts[i:i + concurrency], params, use_tqdm=False)
  wall = time.perf_counter() - t0
  assert alloc.num_used == 0
  ttft = [o.metrics["ttft_s"] * 1e3 for o in outs]
  q = totals["prefix_cache_queries"] - queries
  return {"ttft_ms": ttft, "wall_s": wall, "tokens": [o.outputs[0].token_ids for o in outs],
          "hit_rate": (totals["prefix_cache_hits"] - hits) / q if q else 0.0}


def main(argv):
  del argv
  from absl import flags

  import jax

  from recguide_jax.benchmarks import cli, report, stats
  from recguide_jax.engine.requests import SamplingParams
  from recguide_jax.llm import LLM
  f = flags.FLAGS
  cli.quiet_logging()
  llm = LLM(model=f.model, policy=f.policy, max_model_len=f.max_model_len, page_size=f.page_size,
            prefill_chunk=f.prefill_chunk, max_num_seqs=max(f.concurrency, 1), attention=f.attention,
            dtype=None if f.dtype == "auto" else f.dtype, enable_prefix_caching=True)
  prompts, source = build_prompts(llm.tokenizer, f.prompt_source, f.gsm8k_dir, f.system_tokens, f.question_tokens,
                                  f.num_prompts, llm.cfg.vocab_size, f.seed)
  params = SamplingParams(max_tokens=f.max_tokens, temperature=0.0)
  load_start = os.getloadavg()
  for cached in (False, True):  # untimed: compiles what the timed runs use
    run_once(llm, prompts[:2], params, f.concurrency, cached)
  runs = {False: [], True: []}
  for k in range(f.repeats):
    for cached in ((False, True) if k % 2 == 0 else (True, False)):
      runs[cached].append(run_once(llm, prompts, params, f.concurrency, cached))
  same = all(a["tokens"] == b["tokens"] for a, b in zip(runs[False], runs[True]))

  def summary(rs):
    every = [t for r in rs for t in r["ttft_ms"]]
    later = [t for r in rs for t in r["ttft_ms"][f.concurrency:]]
    return {"ttft_ms_median": statistics.median(every), "ttft_ms_median_after_first": statistics.median(later),
            "ttft_ms_per_repeat": [statistics.median(r["ttft_ms"]) for r in rs],
            "wall_s_per_repeat": [r["wall_s"] for r in rs], "hit_rate": statistics.mean(r["hit_rate"] for r in rs)}

  off, on = summary(runs[False]), summary(runs[True])
  ratio = stats.paired_ratio_interval(on["ttft_ms_per_repeat"], off["ttft_ms_per_repeat"])
  prompt_len = statistics.median(len(p) for p in prompts)
  result = {"meta": {"checkpoint": f.model or "bundled", "policy": f.policy, "prompt_source": source,
                     "system_tokens": f.system_tokens, "prompt_tokens_median": prompt_len,
                     "num_prompts": f.num_prompts, "max_tokens": f.max_tokens, "repeats": f.repeats,
                     "concurrency": f.concurrency, "page_size": f.page_size, "prefill_chunk": f.prefill_chunk,
                     "jax": jax.__version__, "jax_backend": jax.default_backend(), "cpu_count": os.cpu_count(),
                     "load_average_start": list(load_start), "load_average_end": list(os.getloadavg()),
                     "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            "off": off, "on": on, "ttft_ratio_off_over_on": ratio, "outputs_identical": same}
  js, md = report.write_report(result, markdown(result), cli.output_dir(), "bench_prefix_cache")
  print(markdown(result))
  print(f"wrote {js} and {md}")
  if not same:
    sys.exit("error: greedy outputs differ with and without prefix caching")


def markdown(result: dict) -> str:
  m, off, on, r = result["meta"], result["off"], result["on"], result["ttft_ratio_off_over_on"]
  return "\n".join([
      "# Automatic prefix caching: time to first token", "",
      f"Checkpoint `{m['checkpoint']}`, policy {m['policy']}; {m['num_prompts']} requests per run sharing a system "
      f"prompt of {m['system_tokens']} tokens ({m['prompt_source']} prompts, median {m['prompt_tokens_median']:.0f} "
      f"tokens), {m['max_tokens']} greedy tokens each, {m['concurrency']} in flight; KV page {m['page_size']}, "
      f"prefill chunk {m['prefill_chunk']}. {m['repeats']} runs per setting, interleaved, the cache reset before "
      f"each (its first request fills it). jax {m['jax']} ({m['jax_backend']}, {m['cpu_count']} cores), load "
      f"average {m['load_average_start'][0]:.1f} at the start and {m['load_average_end'][0]:.1f} at the end "
      f"({m['time_utc']}).", "",
      "| prefix caching | TTFT median (ms) | after the first request (ms) | run wall (s, median) | hit rate |",
      "|---|---|---|---|---|",
      f"| off | {off['ttft_ms_median']:.1f} | {off['ttft_ms_median_after_first']:.1f} | "
      f"{statistics.median(off['wall_s_per_repeat']):.2f} | {off['hit_rate']:.2f} |",
      f"| on | {on['ttft_ms_median']:.1f} | {on['ttft_ms_median_after_first']:.1f} | "
      f"{statistics.median(on['wall_s_per_repeat']):.2f} | {on['hit_rate']:.2f} |", "",
      f"TTFT off / on (per-repeat medians, geometric mean): {r['geomean']:.2f}x, 95% interval "
      f"[{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}] (on is {r['verdict']}). Greedy outputs identical with and without: "
      f"{result['outputs_identical']}.", ""])


if __name__ == "__main__":
  _define_flags()
  from recguide_jax.benchmarks import cli
  cli.run(main)
