"""Compile time of every step variant a policy needs, at real model shapes, from abstract weights.

For each policy in --policies, a fresh `Runner.abstract` (weights and KV cache as `jax.ShapeDtypeStruct`s of the
--preset model in --dtype: nothing is allocated, so NLD-8B shapes compile on a laptop) lowers and compiles every
variant `LLM` / `launch/serve.py` warm up for that policy (`Runner.variants(policy.step_kinds(), sizes)`), --workers
at a time as `Runner.warmup` does. No persistent compilation cache is used. Reports, per policy, the seconds of each
variant (lowering = Python tracing, compile = XLA; with --workers > 1 variants overlap, so these add up to more
than the wall time), the wall-clock total and the process's CPU seconds (what the compiles cost whatever else runs
on the machine), as JSON and markdown.

  python launch/compile_bench.py                                  # NLD-8B, linear + recguide, CPU -> runs/
  python launch/compile_bench.py --output_dir docs                # the figures in docs/compile_times.md
  python launch/compile_bench.py --preset nld-14b --policies linear --workers 1
"""

import concurrent.futures
import datetime
import json
import os
import platform
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

_PRESET = flags.DEFINE_string("preset", "nld-8b", "Model shapes: a preset of recguide_jax/model/config.py (nld-3b, nld-8b, "
                              "nld-14b) or a checkpoint directory's config.json.")
_LORA_RANK = flags.DEFINE_integer("lora_rank", 128, "Draft LoRA rank (NLD's linear_spec_lora: 128; 0: none).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weight and KV cache dtype.")
_POLICIES = flags.DEFINE_list("policies", ["linear", "recguide"], "Policies whose variants are compiled.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Block size of the linear policy (serve.py's --block_size).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 8, "Largest batch bucket (serve.py's --max_num_seqs).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 1024, "Longest sequence (serve.py's --max_model_len).")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 0, "KV pages; 0: max_num_seqs full-length sequences + the trash page "
                                  "(serve.py's default).")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 64, "Prefill chunk.")
_WORKERS = flags.DEFINE_integer("workers", 0, "Variants compiled at a time; 0: Runner.warmup's default (one per "
                                "CPU core, at most 8).")
_PLATFORM = flags.DEFINE_string("platform", "cpu", "JAX backend to compile for.")
_SCOPE = flags.DEFINE_enum(
    "scope", "all", ["startup", "all"], "startup: only what serve.py compiles before it listens (its default "
    "--background_compile: the largest batch bucket of every variant); all: then the smaller buckets too, timed "
    "apart (serve.py builds them on a background thread while it serves).")
_LIMIT = flags.DEFINE_integer("limit", 0, "Compile only the first N variants of each policy (0: all); a smoke run.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", os.path.join(ROOT, "runs", "compile_bench"),
                                  "Where compile_times.json and compile_times.md go (docs/ for the shipped figures).")
_NOTE = flags.DEFINE_string("note", "", "A line added under the markdown table (e.g. the machine's load).")
_BEFORE_JSON = flags.DEFINE_string("before_json", None, "Sampled compile times of an earlier build, "
                                   '{"source": str, "variants": {"kind/B/batch": {"wall_s": s, "cpu_s": s}}}: each '
                                   "policy's variants are priced with the sample of the same kind (AR decode: "
                                   "verify/1) and summed into an extrapolated before total beside the measured one.")


def model_config():
  from recguide_jax.aot.compile import shapes_config
  try:
    return shapes_config(_PRESET.value, _LORA_RANK.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def policy_runner_config(name: str):
  """(policy, RunnerConfig) exactly as `LLM` builds them for `policy=name` (no block_sizes override)."""
  from recguide_jax.aot.compile import policy_runner_config as serving_config
  from recguide_jax.runtime.runner import RunnerConfig
  policy, rc, _, _ = serving_config(name, block_size=_BLOCK_SIZE.value, max_num_seqs=_MAX_NUM_SEQS.value,
                                    max_model_len=_MAX_MODEL_LEN.value, page_size=_PAGE_SIZE.value,
                                    prefill_chunk=_PREFILL_CHUNK.value)
  pages = _NUM_PAGES.value or _MAX_NUM_SEQS.value * rc.pages_per_seq + 1
  return policy, RunnerConfig(**{**rc.__dict__, "num_pages": pages})


def bench_policy(name: str, cfg, dtype) -> dict:
  from recguide_jax.runtime.runner import MAX_COMPILE_WORKERS, Runner
  policy, rc = policy_runner_config(name)
  runner = Runner.abstract(cfg, rc, dtype)
  variants = runner.variants(policy.step_kinds(), policy.block_sizes())
  if _LIMIT.value:
    variants = variants[:_LIMIT.value]
  workers = max(1, min(len(variants), _WORKERS.value or min(os.cpu_count() or 1, MAX_COMPILE_WORKERS)))
  rows, lock = [], threading.Lock()

  def one(v):
    t0 = time.perf_counter()
    lowered = runner.lower(v)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    row = {"variant": v.name, "kind": v.label, "block": v.block, "batch": v.batch,
           "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2), "seconds": round(t2 - t0, 2)}
    with lock:
      rows.append(row)
      print(f"  {name:9s} {row['variant']:16s} {row['seconds']:7.1f} s (lower {row['lower_s']:.1f}, compile "
            f"{row['compile_s']:.1f})", flush=True)

  startup = [v for v in variants if v.batch == rc.max_batch]
  later = [v for v in variants if v.batch != rc.max_batch] if _SCOPE.value == "all" else []
  print(f"{name}: {len(startup)} start-up variants + {len(later)} background, {workers} at a time", flush=True)
  phases = {}
  for phase, todo in (("startup", startup), ("background", later)):
    if not todo:
      continue
    t0, c0 = time.perf_counter(), time.process_time()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      for fut in [pool.submit(one, v) for v in todo]:
        fut.result()
    phases[phase] = {"num_variants": len(todo), "wall_s": round(time.perf_counter() - t0, 1),
                     "cpu_s": round(time.process_time() - c0, 1)}
  compiled = startup + later
  order = {v.name: i for i, v in enumerate(compiled)}
  rows.sort(key=lambda r: order[r["variant"]])
  for r in rows:
    r["phase"] = "startup" if r["batch"] == rc.max_batch else "background"
  return {"policy": name, "block_sizes": list(rc.block_sizes), "kinds": list(policy.step_kinds()),
          "num_variants": len(compiled), "workers": workers, "num_pages": rc.num_pages, "phases": phases,
          "total_wall_s": round(sum(p["wall_s"] for p in phases.values()), 1),
          "process_cpu_s": round(sum(p["cpu_s"] for p in phases.values()), 1),
          "sum_variant_s": round(sum(r["seconds"] for r in rows), 1), "variants": rows}


def _before_kind(kind: str, blk: int) -> str:
  """The sampled kind that stands in for a variant of the earlier build (same work, same compile)."""
  if kind == "decode":
    return "verify/1"
  if kind == "gverify":  # a greedy verify of B tokens: the verify's forward with the tree sampling path
    return "verify"
  return "fused" if kind.startswith("fused") else kind


def extrapolate_before(report: dict, before: dict) -> dict:
  """Per policy: the earlier build's serial compile seconds for every variant, each priced by its sampled kind."""
  samples = {}
  for name, fig in before["variants"].items():
    kind, blk, _ = name.split("/")
    key = "verify/1" if (kind == "verify" and blk == "1") else kind
    samples.setdefault(key, []).append(fig)
  out = {"source": before.get("source", ""), "samples": before["variants"], "policies": {}}
  for p in report["policies"]:
    wall = cpu = 0.0
    for r in p["variants"]:
      figs = samples.get(_before_kind(r["kind"], r["block"]))
      if not figs:
        raise app.UsageError(f"--before_json has no sample for kind {_before_kind(r['kind'], r['block'])!r}")
      wall += sum(f["wall_s"] for f in figs) / len(figs)
      cpu += sum(f["cpu_s"] for f in figs) / len(figs)
    out["policies"][p["policy"]] = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}
  return out


def markdown(report: dict) -> str:
  cfg = report["model"]
  lines = [f"# Compile times: every step variant at {report['preset']} shapes", "",
           f"Backend `{report['platform']}` on {report['machine']}, {report['cpu_count']} CPU cores, jax "
           f"{report['jax']}; weights and KV cache abstract ({report['dtype']}, {cfg['num_hidden_layers']} layers, "
           f"hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}, LoRA rank {cfg['lora_rank']}); max_num_seqs "
           f"{report['max_num_seqs']}, max_model_len {report['max_model_len']}, page_size {report['page_size']}. "
           f"Written by `launch/compile_bench.py` at {report['time']}.", ""]
  lines += ["Start-up is what `launch/serve.py` compiles before it listens (with its default `--background_compile`: "
            "the largest batch bucket of every variant, which every batch fits); background is the smaller buckets, "
            "built while it serves (their batches run padded in the largest bucket until then; no request waits on "
            "a compile). Wall: elapsed; CPU: the process's CPU seconds (what the compiles cost whatever else runs).",
            "", "| policy | workers | start-up variants | start-up wall (s) | start-up CPU (s) | background variants | "
            "background wall (s) | background CPU (s) | total wall (s) | total CPU (s) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  for p in report["policies"]:
    st = p["phases"].get("startup", {"num_variants": 0, "wall_s": 0.0, "cpu_s": 0.0})
    bg = p["phases"].get("background")
    bg_cells = (f"{bg['num_variants']} | {bg['wall_s']:.1f} | {bg['cpu_s']:.1f}" if bg else "not measured | - | -")
    lines.append(f"| {p['policy']} | {p['workers']} | {st['num_variants']} | {st['wall_s']:.1f} | "
                 f"{st['cpu_s']:.1f} | {bg_cells} | {p['total_wall_s']:.1f} | {p['process_cpu_s']:.1f} |")
  before = report.get("before")
  if before:
    lines += ["", "### Before and after", "",
              f"Before: {before['source']} Sampled variants (serial): " +
              ", ".join(f"{k} {v['wall_s']:.0f} s wall / {v['cpu_s']:.0f} s CPU" for k, v in before["samples"].items()) +
              ". Each variant of a policy is priced with the sample of its kind (AR decode by `verify/1`, the greedy "
              "verify by `verify`, the fused trees by `fused`) and summed: an extrapolation, not a measurement.", "",
              "| policy | variants | before: wall, serial (s, extrapolated) | before: CPU (s, extrapolated) | "
              "after: wall (s) | after: CPU (s) | wall speed-up |", "|---|---|---|---|---|---|---|"]
    for p in report["policies"]:
      b = before["policies"][p["policy"]]
      lines.append(f"| {p['policy']} | {p['num_variants']} | {b['wall_s']:.0f} | {b['cpu_s']:.0f} | "
                   f"{p['total_wall_s']:.0f} | {p['process_cpu_s']:.0f} | {b['wall_s'] / p['total_wall_s']:.1f}x |")
  for p in report["policies"]:
    lines += ["", f"## {p['policy']} (kinds {', '.join(p['kinds'])}; blocks {p['block_sizes']})", "",
              "| variant (kind/B/batch) | phase | lower (s) | compile (s) | total (s) |", "|---|---|---|---|---|"]
    for r in p["variants"]:
      lines.append(f"| {r['variant']} | {r['phase']} | {r['lower_s']:.1f} | {r['compile_s']:.1f} | "
                   f"{r['seconds']:.1f} |")
  if report.get("note"):
    lines += ["", report["note"]]
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  import jax
  jax.config.update("jax_platforms", _PLATFORM.value)
  jax.config.update("jax_enable_compilation_cache", False)  # every variant really compiles
  import jax.numpy as jnp
  from recguide_jax.decoding.registry import strategy_names
  unknown = [p for p in _POLICIES.value if p not in strategy_names()]
  if unknown:
    raise app.UsageError(f"--policies: unknown {unknown}; expected some of {strategy_names()}")
  cfg = model_config()
  dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[_DTYPE.value]
  report = {"preset": _PRESET.value, "dtype": _DTYPE.value, "platform": jax.default_backend(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "model": {k: getattr(cfg, k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                     "vocab_size", "num_attention_heads", "num_key_value_heads",
                                                     "head_dim", "lora_rank")},
            "max_num_seqs": _MAX_NUM_SEQS.value, "max_model_len": _MAX_MODEL_LEN.value, "page_size": _PAGE_SIZE.value,
            "note": _NOTE.value, "policies": [bench_policy(p, cfg, dtype) for p in _POLICIES.value]}
  if _BEFORE_JSON.value:
    with open(_BEFORE_JSON.value) as f:
      report["before"] = extrapolate_before(report, json.load(f))
  for p in report["policies"]:
    for phase, fig in p["phases"].items():
      print(f"{p['policy']} {phase}: {fig['num_variants']} variants in {fig['wall_s']:.1f} s wall, "
            f"{fig['cpu_s']:.1f} s CPU ({p['workers']} at a time)")
  os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
  with open(os.path.join(_OUTPUT_DIR.value, "compile_times.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(_OUTPUT_DIR.value, "compile_times.md"), "w") as f:
    f.write(markdown(report))
  print(f"wrote {_OUTPUT_DIR.value}/compile_times.json and compile_times.md")


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli
  cli.run(main)  # absl's app.run; --help / -h exit 0
