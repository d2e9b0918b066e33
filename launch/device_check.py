"""One-shot check of an accelerator (or, as a smoke run, the CPU): kernels against their reference, an NLD-shaped
model end to end, compile seconds, decode throughput and the memory-bandwidth roofline. JSON + markdown out.

  python launch/device_check.py                        # GPU/TPU: NLD-8B shapes, bf16, random weights
  python launch/device_check.py --model DIR        # a real checkpoint instead of random weights
  python launch/device_check.py --shape tiny            # the CPU default: a tiny model (what the suite runs)

What it runs, in order (each part is timed and recorded; a failed check makes the exit status 1):
1. kernels: the platform's Pallas block attention (interpret mode off its platform) against `block_attention_ref`
   on causal, full and tree-shaped masks over a long ragged paged prefix;
2. lossless end to end: greedy AR == LinearSS B=16 == RecGuide token for token on a few random prompts (in bf16:
   except where AR's own choice was a near-tie, `--tie_margin`; each first divergence is reported with its margin);
3. compile seconds of each policy's warm-up (all its step variants);
4. AR decode tokens/s at each `--concurrency`, and the fraction of the memory-bandwidth roofline: the bytes one decode
   step must read (weights + the live KV) over the measured step time, against the measured device copy bandwidth.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time

from absl import flags

_CHECKPOINT = flags.DEFINE_string("model", None, "Checkpoint directory (default: random weights of --shape).")
_SHAPE = flags.DEFINE_enum("shape", None, ["tiny", "nld-3b", "nld-8b", "nld-14b"],
                           "Model shape for random weights. Default: nld-8b on GPU/TPU, tiny on CPU.")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", None, "Random weights: keep the first N layers of --shape (its layer "
                                   "shapes, a fraction of its compile time and step cost).")
_POLICIES = flags.DEFINE_list("policies", ["ar", "linear", "recguide"],
                              "Policies built, warmed up and checked against AR (ar is always built: it is the "
                              "reference and times the decode).")
_NUM_PAGES = flags.DEFINE_integer("num_pages", None, "KV cache pages (default: the memory plan's on GPU/TPU).")
_TIE_MARGIN = flags.DEFINE_float("tie_margin", None, "A policy may leave greedy AR only where AR's top-1 - top-2 "
                                  "logprob is at most this (nats): bf16 rounding differs between a block and a "
                                  "single token. Default: 0 in float32, 0.1 in bfloat16.")
_DTYPE = flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"],
                           "Weights/KV dtype; auto: bfloat16 on GPU/TPU, float32 on CPU (or the checkpoint's).")
_CONCURRENCY = flags.DEFINE_list("concurrency", None, "Decode batch sizes to time. Default: 1,8,32 (CPU: 1,4).")
_NEW_TOKENS = flags.DEFINE_integer("max_tokens", None, "Tokens generated per request in the timed decode runs "
                                   "(default 64; CPU 16).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens of the random prompts.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 3, "Prompts of the lossless check.")
_ATTENTION = flags.DEFINE_enum("attention", "auto", ["auto", "reference", "pallas"], "Attention implementation.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs/device_check", "Where device_check.{json,md} go.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and prompts.")


def _tiny_config():
  from recguide_jax.model.config import NLDConfig
  return NLDConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, mask_token_id=3, bos_token_id=1, eos_token_ids=(2,),
                   original_max_position_embeddings=256, rope_factor=4.0, block_size=16)


def _model(on_accel: bool):
  import jax.numpy as jnp
  from flax import nnx

  from recguide_jax.model import checkpoint as ckpt_lib
  from recguide_jax.model.config import PRESETS
  from recguide_jax.model.nld import NLDModel
  dtype = _DTYPE.value
  if _CHECKPOINT.value:
    model = ckpt_lib.load_model(_CHECKPOINT.value, dtype=None if dtype == "auto" else dtype)
    return model, f"checkpoint {_CHECKPOINT.value}"
  shape = _SHAPE.value or ("nld-8b" if on_accel else "tiny")
  dtype = dtype if dtype != "auto" else ("bfloat16" if on_accel else "float32")
  cfg = _tiny_config() if shape == "tiny" else PRESETS[shape]
  if _NUM_LAYERS.value:
    if not 1 <= _NUM_LAYERS.value <= cfg.num_hidden_layers:
      raise SystemExit(f"error: --num_layers must be in 1..{cfg.num_hidden_layers} for {shape}, "
                       f"got {_NUM_LAYERS.value}")
    cfg = dataclasses.replace(cfg, num_hidden_layers=_NUM_LAYERS.value)
    shape += f" ({_NUM_LAYERS.value} layers)"
  jdt = jnp.dtype(dtype)
  model = NLDModel(cfg, dtype=jdt, param_dtype=jdt, rngs=nnx.Rngs(_SEED.value))
  return model, f"random {shape} ({dtype})"


def check_kernels(on_accel: bool) -> dict:
  """The platform's kernel (compiled on GPU/TPU, interpreted on CPU) against the jnp reference."""
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.common import causal_mask
  from recguide_jax.attention import dispatch as attention_dispatch
  path, variant, interpret = attention_dispatch.resolve("pallas")
  if variant == "tpu":
    from pallas_kernels import block_attention_tpu as kernel
  else:
    from pallas_kernels import block_attention_gpu as kernel
  if on_accel:
    b, q_len, hq, hkv, d, page, pages_per_seq = 4, 16, 32, 8, 128, 16, 128
  else:
    b, q_len, hq, hkv, d, page, pages_per_seq = 2, 8, 4, 2, 16, 8, 6
  rng = np.random.default_rng(0)
  num_pages = b * pages_per_seq + 1
  dt = jnp.bfloat16 if on_accel else jnp.float32
  f = lambda *s: jnp.asarray(rng.standard_normal(s), dt)
  q, kb, vb = f(b, q_len, hq, d), f(b, q_len, hkv, d), f(b, q_len, hkv, d)
  kp, vp = f(num_pages, page, hkv * d), f(num_pages, page, hkv * d)
  table = jnp.asarray(1 + rng.permutation(b * pages_per_seq).reshape(b, pages_per_seq), jnp.int32)
  cap = pages_per_seq * page
  prefix = jnp.asarray([cap - 3, 0] + [int(rng.integers(1, cap)) for _ in range(b - 2)], jnp.int32)
  tree = causal_mask(q_len)
  tree[q_len // 2:, : q_len // 2] = False  # a second block that sees only itself (a branch of the tree)
  masks = {"causal": causal_mask(q_len), "full": jnp.ones((q_len, q_len), bool),
           "tree": jnp.asarray(tree)}
  out = {"variant": variant, "interpret": interpret, "shape": dict(b=b, q=q_len, hq=hq, hkv=hkv, d=d, page=page,
                                                                    prefix_tokens=cap)}
  tol = 3e-2 if dt == jnp.bfloat16 else 2e-5
  errors = {}
  for name, mask in masks.items():
    kw = dict(k_pages=kp, v_pages=vp, page_table=table, prefix_len=prefix, scale=d ** -0.5)
    got = kernel.block_attention(q, kb, vb, mask, interpret=interpret, **kw)
    want = kernel.block_attention_ref(q, kb, vb, mask, **kw)
    errors[name] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
  out["max_abs_err"] = errors
  out["tolerance"] = tol
  out["ok"] = all(e <= tol for e in errors.values())
  return out


def _margin(entry: dict) -> float | None:
  top = sorted(entry.get("top_logprobs", {}).values(), reverse=True)
  return top[0] - top[1] if len(top) > 1 else None


def _divergence(got: list[list[int]], want: list[list[int]], margins: list[list[float]]) -> list[dict]:
  """Per prompt where `got` first leaves `want` (AR), with AR's top-1/top-2 logprob margin there: in bf16 a verify
  over a block and a decode of one token round differently, so a near-tie may flip; a decisive choice must not."""
  out = []
  for i, (g, w) in enumerate(zip(got, want)):
    k = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
    if k is None and len(g) != len(w):
      k = min(len(g), len(w))
    if k is not None:
      out.append({"prompt": i, "position": k, "ar_margin": margins[i][k] if k < len(margins[i]) else None})
  return out


def copy_bandwidth(on_accel: bool) -> float:
  """Bytes/s of an on-device elementwise pass (read + write) over a large array: the roofline's bandwidth. The
  pass updates its donated input in place and runs 10 times per wait, so neither a fresh output buffer nor the
  host's wait is timed (docs/device_h200.md: one pass per wait read well below the device's copy rate)."""
  import jax
  import jax.numpy as jnp
  n = (1 << 29) if on_accel else (1 << 23)  # 2 GiB / 32 MiB of float32
  passes = 10
  x = jnp.ones((n,), jnp.float32)
  fn = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
  x = fn(x).block_until_ready()
  times = []
  for _ in range(5):
    t = time.perf_counter()
    for _ in range(passes):
      x = fn(x)
    x.block_until_ready()
    times.append((time.perf_counter() - t) / passes)
  return 2 * n * 4 / sorted(times)[len(times) // 2]


def main(argv):
  del argv
  import jax
  import numpy as np
  from flax import nnx

  from recguide_jax import LLM

  from recguide_jax import SamplingParams

  from recguide_jax import benchmarks as bench

  from recguide_jax.parallel import multihost as distributed
  platform = jax.default_backend()
  on_accel = platform in ("gpu", "cuda", "rocm", "tpu")
  report: dict = {"platform": platform, "devices": [str(d) for d in jax.devices()],
                  "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}
  failures = []

  t = time.perf_counter()
  report["kernels"] = check_kernels(on_accel)
  report["kernels"]["seconds"] = time.perf_counter() - t
  if not report["kernels"]["ok"]:
    failures.append(f"kernel vs reference: {report['kernels']['max_abs_err']}")

  model, model_name = _model(on_accel)
  if distributed.mesh_from_flags() is None:
    # arranged for its layer loop once, here: each engine would otherwise copy the layers out of the stacked arrays
    # this reference keeps alive, holding the weights twice (on a GPU 17 GB more for NLD-8B than its plan counts)
    from recguide_jax.model.nld import LayerLoop, with_layer_loop
    model = with_layer_loop(model, LayerLoop.AUTO)
  cfg = model.cfg
  report["model"] = model_name
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  weight_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
  kv_itemsize = leaves[0].dtype.itemsize
  report["weights_gb"] = weight_bytes / 1e9
  conc = [int(c) for c in (_CONCURRENCY.value or (["1", "8", "32"] if on_accel else ["1", "4"]))]
  new_tokens = _NEW_TOKENS.value or (64 if on_accel else 16)
  max_len = _PROMPT_LEN.value + max(new_tokens, 48) + 64
  rng = np.random.default_rng(_SEED.value)
  special = {cfg.mask_token_id, cfg.bos_token_id, *cfg.eos_token_ids}
  ok_ids = np.array([i for i in range(min(cfg.vocab_size, 32000)) if i not in special])
  prompts = [[int(t) for t in rng.choice(ok_ids, _PROMPT_LEN.value)] for _ in range(max(conc + [_NUM_PROMPTS.value]))]

  # 2 + 3: lossless end to end, with each policy's compile seconds; one engine at a time (each plans its KV cache
  # from the device's memory), AR last: it is kept for the decode timing
  greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2)
  pages = _NUM_PAGES.value or (None if on_accel else max(conc) * (max_len // 16 + 4) + 2)
  common = dict(model=model, max_model_len=max_len, max_num_seqs=max(conc), attention=_ATTENTION.value,
                compile_cache_dir=None, num_pages=pages, mesh=distributed.mesh_from_flags())
  outputs, margins, compile_s, llm = {}, {}, {}, None
  others = [p for p in _POLICIES.value if p != "ar"]
  for policy in others + ["ar"]:
    if llm is not None:
      llm.runner.close()
      del llm
      gc.collect()
    t = time.perf_counter()
    llm = LLM(policy=policy, block_size=16, **common)
    compile_s[policy] = time.perf_counter() - t
    outs = llm.generate(prompts[:_NUM_PROMPTS.value], greedy, use_tqdm=False)
    outputs[policy] = [o.outputs[0].token_ids for o in outs]
    if policy == "ar":  # top-1 minus top-2 logprob of every AR token: how near a tie each greedy choice was
      margins = [[_margin(e) for e in o.outputs[0].logprobs] for o in outs]
  report["compile_seconds"] = compile_s
  report["lossless"] = {p: outputs[p] == outputs["ar"] for p in others}
  report["divergence"] = {p: _divergence(outputs[p], outputs["ar"], margins) for p in others}
  tie = _TIE_MARGIN.value if _TIE_MARGIN.value is not None else (0.0 if kv_itemsize >= 4 else 0.1)
  report["tie_margin"] = tie
  # how much the check can say: on random weights most choices are near-ties, and a flip there proves nothing
  flat = [m for row in margins for m in row]
  report["decisive_share"] = sum(m is None or m > tie for m in flat) / len(flat) if flat else 0.0
  for p in others:
    decisive = [d for d in report["divergence"][p] if d["ar_margin"] is None or d["ar_margin"] > tie]
    if decisive:
      failures.append(f"greedy {p} != greedy ar where AR's choice was decisive (margin > {tie} nats): {decisive}")

  # 4: AR decode throughput and the roofline
  bw = copy_bandwidth(on_accel)
  report["copy_bandwidth_gb_s"] = bw / 1e9
  from recguide_jax.runtime.compilation import CompileCounter
  rows, timed_compiles = [], 0
  for c in conc:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:c], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    before = CompileCounter.total()
    t = time.perf_counter()
    llm.generate(prompts[:c], params, use_tqdm=False)
    wall = time.perf_counter() - t
    timed_compiles += CompileCounter.total() - before  # the counter is process-wide: count the timed runs only
    steps = new_tokens  # one decode step per token (the prefill's first token is inside the wall time too)
    step_s = wall / steps
    ctx = _PROMPT_LEN.value + new_tokens / 2
    kv_bytes = 2 * cfg.num_hidden_layers * ctx * cfg.num_key_value_heads * cfg.head_dim * kv_itemsize * c
    step_bytes = weight_bytes + kv_bytes
    rows.append({"concurrency": c, "tokens_per_s": c * new_tokens / wall, "step_ms": 1e3 * step_s,
                 "bytes_per_step_gb": step_bytes / 1e9, "roofline_fraction": step_bytes / step_s / bw})
  report["decode"] = rows
  report["compiles_during_timed_decode"] = timed_compiles
  if timed_compiles:
    failures.append(f"{timed_compiles} compiles during the timed decode runs (a variant missing from warm-up)")
  report["ok"] = not failures
  report["failures"] = failures

  md = [f"# device_check: {report['device_kind']} ({platform}), {model_name}", "",
        f"- kernels ({report['kernels']['variant']}, interpret={report['kernels']['interpret']}): max abs err "
        f"{report['kernels']['max_abs_err']} (tolerance {report['kernels']['tolerance']})",
        "- greedy AR == " + ("; == ".join(f"{p}: {same}" for p, same in report["lossless"].items()) or "(none checked)")
        + "".join(f"; {p} first differs at {[(d['prompt'], d['position'], d['ar_margin']) for d in ds]} "
                  f"(prompt, token, AR top-1 - top-2 logprob)" for p, ds in report["divergence"].items() if ds)
        + f"; {report['decisive_share']:.0%} of AR's choices decisive (margin > {tie} nats)",
        "- compile seconds (warm-up of every variant): " + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items()),
        f"- copy bandwidth: {bw / 1e9:.1f} GB/s; weights {weight_bytes / 1e9:.3f} GB", "",
        "| C | decode tok/s | step ms | bytes/step GB | roofline fraction |", "|---|---|---|---|---|"]
  md += [f"| {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | {r['bytes_per_step_gb']:.4f} | "
         f"{r['roofline_fraction']:.3f} |" for r in rows]
  md += ["", f"Result: {'OK' if report['ok'] else 'FAILED: ' + '; '.join(failures)}", ""]
  bench.write_report(report, "\n".join(md), _OUTPUT_DIR.value, "device_check")
  print("\n".join(md))
  return 0 if report["ok"] else 1


if __name__ == "__main__":
  import os
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
  from recguide_jax.parallel import multihost as distributed
  from recguide_jax.benchmarks import cli
  # --tensor_parallel_size/--data_parallel_size/--mesh: the end-to-end checks run on that mesh
  distributed.define_mesh_flags()
  cli.run(lambda argv: sys.exit(main(argv)))  # absl's app.run; --help / -h exit 0
