"""Compile every step variant `serve.py` builds, for a TPU slice or a GPU this host does not have, and check them.

The real compilers run on this CPU: libtpu (`pip install "jax[tpu]"`) for TPU slices, XLA:GPU and Triton
(`pip install -e ".[cuda]"`) for NVIDIA GPUs, from abstract weights (nothing is allocated). Per target and policy:
the memory plan `serve.py` would make on the chip (memory_plan.fit_activation: every variant compiled at the plan's
own cache size, planned again while one needs more than the reserve; "plan vs compiled" is printed), then per
variant the per-device arguments / temporaries / output / aliased bytes and compile seconds, and checks that fail
the run (exit status 1):
- the plan fits the chip (a MemoryPlanError: nothing left for the KV cache once the weights and the reserve are in),
- temporaries under --temp_limit of the device's KV cache (a larger one is a copy of the cache; the largest such
  HLO instructions are named),
- transient memory within the activation reserve of the plan,
- no sort over the whole vocabulary.

  python launch/aot_compile.py --target v5e:2x2 --tensor_parallel_size 4          # NLD-8B, linear + recguide
  python launch/aot_compile.py --target h200 --preset nld-14b --scope startup
  python launch/aot_compile.py --target h100:2 --output_dir docs/aot                # the figures in docs/aot/

Targets (recguide_jax/aot/targets.py): v5e, v6e, v5p slices as CHIP:AxB[xC]; h100, h200, b200 as CHIP[:N].
Each run writes aot_<preset>_<target>_tp<N>_<policy>.json and rewrites aot_compile.md from every JSON there.
"""

import collections
import datetime
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from recguide_jax.aot import targets  # noqa: E402

targets.prepare_environment()  # before jax starts a backend

from absl import app, flags  # noqa: E402

_TARGET = flags.DEFINE_string("target", "v5e:2x2", "Chip and count: v5e:2x2, v6e:1x1, v5p:2x2x1, h200, h100:2, b200:8.")
_TP = flags.DEFINE_integer("tensor_parallel_size", 0, "Devices of the tp group (0: every device of --target).")
_PRESET = flags.DEFINE_string("preset", "nld-8b", "Model shapes: nld-3b, nld-8b, nld-14b, or a checkpoint directory.")
_LORA_RANK = flags.DEFINE_integer("lora_rank", 128, "Draft LoRA rank (NLD's linear_spec_lora: 128; 0: none).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weight and KV cache dtype.")
_POLICIES = flags.DEFINE_list("policies", ["linear", "recguide"], "Policies whose variants are compiled.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Block size of the linear policy.")
_BUCKETING = flags.DEFINE_enum("bucketing", "auto", ["auto", "ragged"], "serve.py's --bucketing: ragged also "
                               "compiles the ragged draft and verify of every packed-token bucket.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "Largest batch bucket (serve.py's --max_num_seqs).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 4096, "Longest sequence (serve.py's --max_model_len).")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 0, "KV pages per device (0: what the memory plan fits).")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 64, "Prefill chunk.")
_ATTENTION = flags.DEFINE_enum("attention", "pallas", ["pallas", "reference"], "Attention implementation.")
_UTILIZATION = flags.DEFINE_float("gpu_memory_utilization", 0.9, "Fraction of the device's memory the plan uses.")
_TEMP_LIMIT = flags.DEFINE_float("temp_limit", 0.1, "Largest temporaries allowed, as a fraction of the device's KV "
                                 "cache.")
_SCOPE = flags.DEFINE_enum("scope", "all", ["startup", "all"], "startup: the largest batch bucket of every variant "
                           "(what serve.py compiles before it listens); all: every bucket.")
_VARIANTS = flags.DEFINE_list("variants", [], "Only the variants whose kind/block/batch name matches one of these "
                              "patterns (fused/32/*); the plan's reserve then covers these only. Default: all.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", os.path.join(ROOT, "runs", "aot"), "Where the JSON and the "
                                  "markdown go (docs/aot for the shipped table).")


def model_config():
  from recguide_jax.aot.compile import shapes_config
  try:
    return shapes_config(_PRESET.value, _LORA_RANK.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def as_json(report) -> dict:
  variants = []
  for v in report.variants:
    row = {k: getattr(v, k) for k in ("variant", "label", "compile_s", "argument_bytes", "temp_bytes", "output_bytes",
                                      "alias_bytes", "transient_bytes", "kernel_calls")}
    row["large_buffers"] = [b.__dict__ for b in v.large_buffers[:5]]
    row["weight_copies"] = [b.__dict__ for b in v.weight_copies[:5]]
    row["vocabulary_sorts"] = list(v.vocabulary_sorts)
    row["problems"] = v.problems(report.cache_bytes_per_device, report.temp_limit, report.plan.activation_bytes)
    variants.append(row)
  return {"plan": report.plan.as_dict(), "plan_summary": report.plan.summary(),
          "probe_reserve_bytes": report.probe_reserve_bytes,
          "replans": [{"reserve_bytes": r, "variant": n, "transient_bytes": t} for r, n, t in report.replans],
          "cache_bytes_per_device": report.cache_bytes_per_device, "layer_loop": report.layer_loop,
          "variants": variants, "fits": True, "ok": not report.problems}


def markdown(runs: list[dict]) -> str:
  gb = lambda n: f"{n / 1e9:.2f}"
  lines = ["# Ahead-of-time compiles for accelerators (libtpu, XLA:GPU) from a CPU host", "",
           "Written by `launch/aot_compile.py`: every step variant of the policy compiled by the target's own compiler "
           "from abstract weights, at the KV cache the memory plan fits on the chip (`--gpu_memory_utilization` "
           "0.9 by default). Per device; GB = 1e9 bytes. Temp: XLA's temporaries; transient: temporaries plus the "
           "inputs and outputs that are neither weights nor cache; reserve: the plan's activation reserve, from every "
           "variant compiled at the plan's cache size (first: the largest variant of each kind, compiled at a cache "
           "that leaves 10% of the budget to activations, where the plan starts; memory_plan.fit_activation). A run "
           "is OK when every variant's temporaries are under the limit of the cache, its transient memory within "
           "the reserve, no step copies a weight into another layout (docs/aot/tpu_weight_layout.md), and none sorts "
           "the vocabulary. Layers: the layer loop the target runs (`--layer_loop auto`: unrolled on GPUs, where "
           "XLA:GPU copies the weight slices a scan takes; scan on TPUs).", "",
           "| model | target | tp | policy | layers | variants | weights GB | KV cache GB | reserve GB (first) | "
           "largest temp GB (variant) | largest transient GB (variant) | compile s (sum) | OK |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(runs, key=lambda r: (r["preset"], r["target"], r["tp"], r["policy"], r.get("bucketing", "auto"))):
    policy = r["policy"] + (" (ragged steps)" if r.get("bucketing") == "ragged" else "")
    if not r["fits"]:
      lines.append(f"| {r['preset']} | {r['target']} | {r['tp']} | {policy} | - | - | - | - | - | - | - | - | "
                   f"does not fit: {r['error']} |")
      continue
    vs, plan = r["variants"], r["plan"]
    top = max(vs, key=lambda v: v["temp_bytes"])
    peak = max(vs, key=lambda v: v["transient_bytes"])
    first = f" ({gb(r['probe_reserve_bytes'])})" if r.get("probe_reserve_bytes") else ""
    # each kind of problem once, with the variants it hits ("temporaries > 10% of the device's KV cache in 12 of 15")
    problems = collections.Counter(re.sub(r" [\d.]+ GB", "", p.split(" (")[0]) for v in vs for p in v["problems"])
    verdict = "yes" if r["ok"] else "no: " + "; ".join(f"{p} in {n} of {len(vs)}" for p, n in sorted(problems.items()))
    if any("weight_copies" not in v for v in vs):
      verdict += " (written before weight copies were checked)"
    lines.append(f"| {r['preset']} | {r['target']} | {r['tp']} | {policy} | {r.get('layer_loop', 'scan')} | "
                 f"{len(vs)} ({r['scope']}) | "
                 f"{gb(plan['weights_bytes'])} | {gb(r['cache_bytes_per_device'])} | "
                 f"{gb(plan['activation_bytes'] or 0)}{first} | {gb(top['temp_bytes'])} ({top['variant']}) | "
                 f"{gb(peak['transient_bytes'])} ({peak['variant']}) | {sum(v['compile_s'] for v in vs):.0f} | "
                 f"{verdict} |")
  lines += ["", "Per variant: the JSON files beside this one (`variants`: bytes, compile seconds, kernel custom calls, "
            "the largest buffers, weight copies, vocabulary sorts)."]
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  try:
    target = targets.parse_target(_TARGET.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  why = targets.missing_compiler(target.platform)
  if why:
    raise app.UsageError(f"--target {target.name}: {why}")
  import jax
  from recguide_jax.aot.compile import plan_and_compile
  from recguide_jax.decoding.registry import strategy_names
  from recguide_jax.cache.memory_plan import MemoryPlanError
  unknown = [p for p in _POLICIES.value if p not in strategy_names()]
  if unknown:
    raise app.UsageError(f"--policies: unknown {unknown}; expected some of {strategy_names()}")
  tp = _TP.value or target.num_devices
  cfg = model_config()
  os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
  preset = os.path.basename(os.path.normpath(_PRESET.value))
  failed = False
  for policy in _POLICIES.value:
    run = {"preset": preset, "target": target.name, "chip": target.chip.description, "tp": tp, "policy": policy,
           "bucketing": _BUCKETING.value,
           "scope": _SCOPE.value if not _VARIANTS.value else f"{_SCOPE.value}, {','.join(_VARIANTS.value)}", "dtype": _DTYPE.value, "attention": _ATTENTION.value, "jax": jax.__version__,
           "max_num_seqs": _MAX_NUM_SEQS.value, "max_model_len": _MAX_MODEL_LEN.value, "page_size": _PAGE_SIZE.value,
           "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:
      report = plan_and_compile(
          cfg, target, policy=policy, tp=tp, dtype=_DTYPE.value, block_size=_BLOCK_SIZE.value,
          max_num_seqs=_MAX_NUM_SEQS.value, max_model_len=_MAX_MODEL_LEN.value, page_size=_PAGE_SIZE.value,
          prefill_chunk=_PREFILL_CHUNK.value, num_pages=_NUM_PAGES.value or None, fraction=_UTILIZATION.value,
          attention=_ATTENTION.value, temp_limit=_TEMP_LIMIT.value, startup_only=_SCOPE.value == "startup",
          only=tuple(_VARIANTS.value), bucketing=_BUCKETING.value,
          progress=lambda line: print(line, flush=True))
      run.update(as_json(report))
    except MemoryPlanError as e:
      print(f"{target.name} tp={tp} {policy}: {e}", flush=True)
      run.update(fits=False, ok=False, error=str(e).split(";")[0])
    failed |= not run["ok"]
    ragged = "_ragged" if _BUCKETING.value == "ragged" else ""
    name = f"aot_{preset}_{target.name.replace(':', '_')}_tp{tp}_{policy}{ragged}.json"
    with open(os.path.join(_OUTPUT_DIR.value, name), "w") as f:
      json.dump(run, f, indent=1)
    print(f"{policy}: {'OK' if run['ok'] else 'FAILED'} -> {os.path.join(_OUTPUT_DIR.value, name)}", flush=True)
  runs = []
  for path in sorted(glob.glob(os.path.join(_OUTPUT_DIR.value, "aot_*.json"))):
    with open(path) as f:
      runs.append(json.load(f))
  with open(os.path.join(_OUTPUT_DIR.value, "aot_compile.md"), "w") as f:
    f.write(markdown(runs))
  print(f"wrote {os.path.join(_OUTPUT_DIR.value, 'aot_compile.md')}")
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli
  cli.run(main)
