"""Evaluates a checkpoint the way the model card reports it: held-out AR loss on GSM8K test, and with the engine
(greedy, --max_tokens new tokens) LinearSS tau and TPF at B = 8/16/32, the accepted-length histogram at B = 16,
the share of outputs ending in a repetition loop, and the draft signals RecGuide relies on (confidence and
top-1/top-2 margin of accepted vs first-rejected positions; how often the verifier's correction is the draft's
runner-up). Writes JSON (and prints markdown).

  python launch/eval_model.py --num_prompts 200 --output_dir docs   # docs/model_eval.json (default: runs/eval_model/)
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_and_data_flags("test", num_prompts=200, max_tokens=128)
flags.DEFINE_integer("concurrency", 8, "Requests in flight (does not change greedy outputs).")
cli.define_output_flags("eval_model")


def heldout_ar_loss(model, tokenizer, rows, batch=16, seq_len=512):
  """Mean next-token cross-entropy (nats/token) over GSM8K test rendered with the chat template."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels.common import causal_mask
  from recguide_jax.model.nld import ForwardInputs
  from recguide_jax.train import data as data_lib
  docs = [tokenizer.encode(data_lib.render(data_lib.gsm8k_messages(r)))[:seq_len] for r in rows]

  @jax.jit
  def ce(tokens, valid):
    n = tokens.shape[1]
    logits, _ = model(ForwardInputs(tokens=tokens, positions=jnp.broadcast_to(jnp.arange(n), tokens.shape),
                                    block_mask=causal_mask(n)))
    lp = jax.nn.log_softmax(logits[:, :-1], -1)
    nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
    m = valid[:, 1:]
    return jnp.sum(nll * m), jnp.sum(m)

  total = count = 0.0
  for i in range(0, len(docs), batch):
    chunk = docs[i:i + batch]
    arr = np.zeros((batch, seq_len), np.int32)
    valid = np.zeros((batch, seq_len), np.float32)
    for j, d in enumerate(chunk):
      arr[j, :len(d)] = d
      valid[j, :len(d)] = 1
    s, c = ce(arr, valid)
    total += float(s)
    count += float(c)
  return total / count


def signal_stats(log):
  import numpy as np
  acc_conf, acc_margin, rej_conf, rej_margin, alt_hits, rejections = [], [], [], [], 0, 0
  for e in log:
    a, blk = e["accepted"], e["block_size"]
    for j in range(1, a):  # accepted draft positions
      acc_conf.append(e["conf"][j])
      acc_margin.append(e["margin"][j])
    if a < blk:  # position a is the first rejected draft; out[a-1] is the verifier's correction there
      rej_conf.append(e["conf"][a])
      rej_margin.append(e["margin"][a])
      rejections += 1
      alt_hits += int(e["alt"][a] == e["out"][a - 1])
  mean = lambda x: float(np.mean(x)) if x else None
  return {"accepted_confidence": mean(acc_conf), "accepted_margin": mean(acc_margin),
          "rejected_confidence": mean(rej_conf), "rejected_margin": mean(rej_margin),
          "correction_is_runner_up": alt_hits / rejections if rejections else None,
          "accepted_positions": len(acc_conf), "rejections": rejections}


def main(argv):
  del argv
  cli.quiet_logging()
  import numpy as np
  data = cli.data_path()
  from recguide_jax import LLM
  from recguide_jax import SamplingParams
  from recguide_jax import benchmarks as bench
  from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
  from recguide_jax.decoding.rounds import draft_signal_rows
  from recguide_jax.train import data as data_lib
  llm = LLM(FLAGS.model, policy="ar", block_sizes=(8, 16, 32), max_num_seqs=FLAGS.concurrency, warmup=False,
            attention=FLAGS.attention, dtype=FLAGS.dtype, max_model_len=FLAGS.max_model_len)
  llm.runner.warmup(("prefill", "draft", "verify"), (8, 16, 32))
  rows = data_lib.load_gsm8k(data)
  result = {"checkpoint": str(FLAGS.model or "bundled"), "num_prompts": FLAGS.num_prompts,
            "max_tokens": FLAGS.max_tokens}
  result["heldout_ar_ce"] = heldout_ar_loss(llm.model, llm.tokenizer, rows)
  print(f"held-out AR CE on GSM8K test ({len(rows)} problems): {result['heldout_ar_ce']:.4f} nats/token")
  prompts = bench.gsm8k_prompts(data, FLAGS.num_prompts, llm.tokenizer)
  params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0)
  llm.set_policy(ARStrategy())
  ar_reqs, _ = bench.run_concurrent(llm.engine, prompts, params, FLAGS.concurrency)
  ar_out = [r.output_ids for r in ar_reqs]
  result["loop_share_ar"] = bench.loop_share(ar_out)
  result["linear"] = {}
  per_request = {}
  for blk in (8, 16, 32):
    llm.set_policy(LinearStrategy(blk))
    llm.engine.round_log = []
    reqs, wall = bench.run_concurrent(llm.engine, prompts, params, FLAGS.concurrency)
    s = bench.summarize(reqs, wall)
    acc = [a for r in reqs for a in r.stats.accepted_lengths]
    per_request[blk] = [(sum(r.stats.accepted_lengths), len(r.stats.accepted_lengths)) for r in reqs
                        if r.stats.accepted_lengths]
    s["lossless"] = [r.output_ids for r in reqs] == ar_out
    s["accepted_length_histogram"] = np.bincount(acc, minlength=blk + 1)[1:].tolist()
    s["signals"] = signal_stats(draft_signal_rows(llm.engine.round_log))
    llm.engine.round_log = None
    result["linear"][blk] = s
    print(f"B={blk}: tau {s['mean_accepted_length']:.2f}  TPF {s['tpf']:.2f}  lossless {s['lossless']}  "
          f"signals {s['signals']}", flush=True)
  if all(len(per_request[b]) == len(per_request[8]) for b in (16, 32)):  # the same prompts decoded at each B
    result["tau_gain"] = {f"{large}_vs_{small}": bench.paired_tau_gain(per_request, small, large)
                          for small, large in ((8, 16), (8, 32), (16, 32))}
    for key, g in result["tau_gain"].items():
      print(f"tau gain B={key.replace('_vs_', ' vs B=')}: {g['diff']:+.3f} (95% CI {g['ci95'][0]:+.3f} .. "
            f"{g['ci95'][1]:+.3f}, bootstrap over {g['prompts']} prompts)")
  out_json = cli.report_path("model_eval.json")
  with open(out_json, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {out_json}")
  print(f"loops (AR greedy): {100 * result['loop_share_ar']:.1f}% of outputs")
  print("histogram B=16 (accepted length 1..16):", result["linear"][16]["accepted_length_histogram"])


if __name__ == "__main__":
  cli.run(main)
