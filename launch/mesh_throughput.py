"""Decode throughput of the bundled model on tp meshes of simulated CPU devices, as ratios to one device.

  python launch/mesh_throughput.py --meshes='tp=1;tp=2;tp=4;tp=8' --concurrency=8 --output_dir=docs

Greedy AR at concurrency C: C copies of one GSM8K-style prompt decode `--max_tokens` tokens together (ignore_eos),
so every step runs the same batch bucket; the first run compiles, the median of `--repeats` timed runs is kept and
nothing may compile during them. On simulated CPU devices all "devices" share this host's cores, so the table shows
the correctness and the overhead of the SPMD programs (collectives, per-shard dispatch), not a speed-up.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_MESHES = flags.DEFINE_string("meshes", "tp=1;tp=2;tp=4;tp=8", "Meshes, ';'-separated (tp=1: one device, no mesh).")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 8, "Requests decoded together.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "Tokens per request.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per mesh (median kept).")
_DEVICES = flags.DEFINE_integer("devices", 8, "Simulated CPU devices (0: leave XLA_FLAGS alone).")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs", "Where mesh_throughput.{json,md} go.")

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def main(argv) -> int:
  del argv
  from recguide_jax.parallel import multihost as distributed
  distributed.simulate_cpu_devices(_DEVICES.value)
  import jax
  from recguide_jax import LLM
  from recguide_jax import SamplingParams
  from recguide_jax.model import checkpoint
  from recguide_jax.llm import BUNDLED_CHECKPOINT
  from recguide_jax.text.tokenizer import Tokenizer
  model = checkpoint.load_model(BUNDLED_CHECKPOINT)
  prompt = Tokenizer.from_dir(BUNDLED_CHECKPOINT).encode(PROMPT)
  c = _CONCURRENCY.value
  params = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=0.0, ignore_eos=True)
  rows, tokens = [], None
  for spec in [s for s in _MESHES.value.split(";") if s]:
    mesh = None if spec in ("tp=1", "dp=1,tp=1") else spec
    llm = LLM(model=model, policy="ar", max_num_seqs=c, max_model_len=256, warmup=False, compile_cache_dir=None,
              mesh=mesh)
    # the first generation compiles what it needs
    first = [o.outputs[0].token_ids for o in llm.generate([prompt] * c, params, use_tqdm=False)]
    tokens = tokens or first
    llm.runner.mark_warm()
    times = []
    for _ in range(_REPEATS.value):
      t0 = time.perf_counter()
      outs = llm.generate([prompt] * c, params, use_tqdm=False)
      times.append(time.perf_counter() - t0)
      assert [o.outputs[0].token_ids for o in outs] == tokens, f"{spec}: tokens differ from tp=1"
    sec = statistics.median(times)
    rows.append({"mesh": spec, "seconds": sec, "tokens_per_s": c * _MAX_TOKENS.value / sec,
                 "compiles_after_warmup": llm.runner.compiles_after_warmup, "same_tokens": True})
    print(json.dumps(rows[-1]), flush=True)
  base = rows[0]["tokens_per_s"]
  for r in rows:
    r["ratio"] = r["tokens_per_s"] / base
  report = {"concurrency": c, "max_tokens": _MAX_TOKENS.value, "repeats": _REPEATS.value, "policy": "ar",
            "devices": len(jax.devices()), "cpu_cores": os.cpu_count(), "rows": rows}
  md = ["# Decode throughput on tp meshes of simulated CPU devices", "",
        f"Bundled model, greedy AR, concurrency {c}, {_MAX_TOKENS.value} tokens per request, median of "
        f"{_REPEATS.value} runs after a compiling run; `python launch/mesh_throughput.py`. The {len(jax.devices())} "
        f"\"devices\" are XLA's simulated CPU devices sharing this host's {os.cpu_count()} cores, so this measures the "
        "overhead of the sharded programs (collectives, per-shard dispatch on shared cores), not a speed-up: on real "
        "chips each shard has its own compute and memory bandwidth.", "",
        "| mesh | tokens/s | ratio to tp=1 | same tokens as tp=1 | compiles after warm-up |", "|---|---:|---:|---|---:|"]
  md += [f"| {r['mesh']} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f} | {'yes' if r['same_tokens'] else 'NO'} | "
         f"{r['compiles_after_warmup']} |" for r in rows]
  os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
  with open(os.path.join(_OUTPUT_DIR.value, "mesh_throughput.json"), "w") as f:
    json.dump(report, f, indent=2)
  with open(os.path.join(_OUTPUT_DIR.value, "mesh_throughput.md"), "w") as f:
    f.write("\n".join(md) + "\n")
  print("\n".join(md))
  return 0


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli
  cli.run(lambda argv: sys.exit(main(argv)))  # absl's app.run; --help / -h exit 0
