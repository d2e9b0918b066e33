"""Block attention over the paged KV cache: Pallas kernel vs the jnp reference, per shape. Reports the median time,
achieved bytes/s (prefix K/V read + q/out/block K/V) and FLOP/s (q @ k and p @ v over prefix + block), the kernel's
max abs error against the reference (--check), and for the GPU kernel its prefix split count (split-K programs per
request, KV head and row block; docs/kernels.md). `--num_splits auto,1` times the split rule against the
single-pass kernel.

Default shapes are the 8B model's (32 q heads, 8 KV heads, head_dim 128, bf16) at block sizes 8/16/32, batch
1..128 and prefixes 512..8192. On a GPU or TPU:

  python launch/bench_kernels.py --output_dir docs      # docs/bench_kernels.json (default: runs/bench_kernels/)

On CPU the kernels only run interpreted (minutes per shape, and the timing says nothing about a device), so the
pallas path is refused unless --interpret; --quick shrinks everything to shapes the interpreter gets through:

  python launch/bench_kernels.py --interpret --quick
"""

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("block_sizes", ["8", "16", "32"], "Query tokens per request (the draft/verify block size).")
flags.DEFINE_list("concurrency", ["1", "8", "32", "128"], "Requests per call (C, the batch decoded together).")
flags.DEFINE_list("prefix", ["512", "2048", "8192"], "Committed prefix length of every request.")
flags.DEFINE_list("masks", ["causal", "full"], "Intra-block masks: causal (verify), full (draft), tree (random).")
flags.DEFINE_list("impls", ["pallas", "reference"], "Implementations to time.")
flags.DEFINE_list("num_splits", ["auto"], "GPU kernel prefix splits to time: 'auto' (the split rule) and/or counts.")
flags.DEFINE_enum("variant", "auto", ["auto", "gpu", "tpu"], "Kernel variant (auto: the platform's).")
flags.DEFINE_integer("q_heads", 32, "Query heads.")
flags.DEFINE_integer("kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dimension.")
flags.DEFINE_integer("page_size", 16, "KV page size (tokens).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "q/k/v and cache dtype.")
flags.DEFINE_integer("repeats", 10, "Timed calls per shape (the median is reported).")
flags.DEFINE_float("max_cache_gib", 24.0, "Skip shapes whose K+V prefix pages exceed this.")
flags.DEFINE_bool("interpret", False, "Run the kernels in interpret mode (the only way on CPU).")
flags.DEFINE_bool("quick", False, "Tiny shapes for a CPU/interpret smoke run.")
flags.DEFINE_bool("check", True, "Also compare each kernel output with the reference (max abs error).")
cli.define_output_flags("bench_kernels")


def _ints(name):
  try:
    vals = [int(v) for v in getattr(FLAGS, name)]
  except ValueError:
    sys.exit(f"error: --{name} must be integers")
  if any(v < 0 for v in vals) or (name != "prefix" and any(v == 0 for v in vals)):
    sys.exit(f"error: --{name} must be positive")
  return vals


def _median_seconds(fn, args, repeats):
  import jax
  jax.block_until_ready(fn(*args))  # compile + warm
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def _callable(impl, kernel_mod, mask, dense, scale, num_splits=None):
  """A jitted f(q, k_block, v_block, k_pages, v_pages, page_table, prefix_len) for one implementation."""
  import jax
  if impl == "pallas":
    extra = {} if num_splits is None else dict(num_splits=num_splits)  # GPU only
    def fn(q, kb, vb, kp, vp, pt, plen):
      return kernel_mod.block_attention(q, kb, vb, mask, k_pages=kp, v_pages=vp, page_table=pt, prefix_len=plen,
                                        scale=scale, interpret=FLAGS.interpret, **extra)
  else:
    def fn(q, kb, vb, kp, vp, pt, plen):
      return kernel_mod.block_attention_ref(q, kb, vb, dense, k_pages=kp, v_pages=vp, page_table=pt,
                                            prefix_len=plen, scale=scale)
  return jax.jit(fn)


def _split_options():
  """--num_splits as [None (the rule) | int]."""
  out = []
  for v in FLAGS.num_splits:
    if v == "auto":
      out.append(None)
    elif v.isdigit() and int(v) > 0:
      out.append(int(v))
    else:
      sys.exit(f"error: --num_splits entries must be 'auto' or positive integers, got {v!r}")
  return out


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels import block_attention_gpu, block_attention_tpu, common

  platform = jax.default_backend()
  if FLAGS.quick:
    blocks, batches, prefixes = [8], [1, 2], [0, 300]  # 300 keys: 3 prefix steps, so --num_splits 2 splits
    hq, hkv, d, ps, repeats = 4, 2, 16, 8, 2
  else:
    blocks, batches, prefixes = _ints("block_sizes"), _ints("concurrency"), _ints("prefix")
    hq, hkv, d, ps, repeats = FLAGS.q_heads, FLAGS.kv_heads, FLAGS.head_dim, FLAGS.page_size, FLAGS.repeats
  if hq % hkv or min(hq, hkv, d, ps, repeats) <= 0:
    sys.exit("error: --q_heads must be a multiple of --kv_heads and all sizes positive")
  bad = set(FLAGS.masks) - {"causal", "full", "tree"} or set(FLAGS.impls) - {"pallas", "reference"}
  if bad:
    sys.exit(f"error: unknown --masks/--impls entries {sorted(bad)}")
  if "pallas" in FLAGS.impls and platform == "cpu" and not FLAGS.interpret:
    sys.exit("error: no GPU/TPU here: the Pallas kernels only run interpreted on CPU; pass --interpret "
             "(with --quick: interpreter timings are for smoke tests, not performance)")
  variant = FLAGS.variant if FLAGS.variant != "auto" else ("tpu" if platform == "tpu" else "gpu")
  if "pallas" in FLAGS.impls and not FLAGS.interpret and (variant == "tpu") != (platform == "tpu"):
    sys.exit(f"error: the {variant} kernel does not compile on {platform}; pass --interpret or another --variant")
  kernel_mod = block_attention_tpu if variant == "tpu" else block_attention_gpu
  split_options = _split_options() if variant == "gpu" else [None]
  dtype = jnp.dtype(FLAGS.dtype)
  item = dtype.itemsize
  print(f"platform={platform} variant={variant} interpret={FLAGS.interpret} dtype={dtype.name} "
        f"heads={hq}/{hkv} head_dim={d} page_size={ps}", flush=True)

  rows = []
  rng = np.random.default_rng(0)
  for blk in blocks:
    for b in batches:
      for prefix in prefixes:
        pages_per_seq = max(1, -(-prefix // ps))
        cache_bytes = 2 * b * pages_per_seq * ps * hkv * d * item
        if cache_bytes > FLAGS.max_cache_gib * 2 ** 30:
          print(f"skip B={blk} batch={b} prefix={prefix}: {cache_bytes / 2 ** 30:.1f} GiB of pages", flush=True)
          continue
        key = jax.random.key(blk * 100003 + b * 101 + prefix)
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        q = jax.random.normal(k1, (b, blk, hq, d), dtype)
        kb = jax.random.normal(k2, (b, blk, hkv, d), dtype)
        vb = jax.random.normal(k3, (b, blk, hkv, d), dtype)
        num_pages = b * pages_per_seq + 1
        k_pages = jax.random.normal(k4, (num_pages, ps, hkv * d), dtype)
        v_pages = jax.random.normal(k5, (num_pages, ps, hkv * d), dtype)
        table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(b, pages_per_seq), jnp.int32)
        plen = jnp.full((b,), prefix, jnp.int32)
        bytes_moved = (2 * b * prefix * hkv * d + 2 * b * blk * hq * d + 2 * b * blk * hkv * d) * item
        flops = 4 * b * hq * blk * (prefix + blk) * d
        for mask_name in FLAGS.masks:
          if mask_name == "tree":
            m = np.tril(rng.random((blk, blk)) < 0.5) | np.eye(blk, dtype=bool)
            mask = jnp.asarray(m)
          else:
            mask = mask_name
          args = (q, kb, vb, k_pages, v_pages, table, plen)
          dense = common.dense_mask(mask, b, blk)
          expected = _callable("reference", kernel_mod, mask, dense, d ** -0.5)(*args) if FLAGS.check else None
          runs = [(impl, s) for impl in FLAGS.impls for s in (split_options if impl == "pallas" else [None])]
          for impl, num_splits in runs:
            call = _callable(impl, kernel_mod, mask, dense, d ** -0.5, num_splits)
            splits = 1
            if impl == "pallas" and variant == "gpu":
              splits = block_attention_gpu.launch_plan(b, blk, hq, hkv, ps, pages_per_seq,
                                                       num_splits=num_splits).splits
            err = None
            if expected is not None and impl == "pallas":  # the first compiled run on a device is also a test
              err = float(jnp.max(jnp.abs(call(*args).astype(jnp.float32) - expected.astype(jnp.float32))))
            sec = _median_seconds(call, args, repeats)
            row = dict(impl=impl, variant=variant if impl == "pallas" else "xla", mask=mask_name, block=blk,
                       batch=b, prefix=prefix, splits=splits if impl == "pallas" else None,
                       split_rule=impl == "pallas" and num_splits is None, ms=sec * 1e3,
                       gb_per_s=bytes_moved / sec / 1e9, tflop_per_s=flops / sec / 1e12, max_abs_err=err,
                       interpret=FLAGS.interpret and impl == "pallas")
            rows.append(row)
            split_txt = f"splits={splits:<3}" if impl == "pallas" else " " * 10
            print(f"{impl:<9} {mask_name:<6} B={blk:<3} batch={b:<4} prefix={prefix:<5} {split_txt} "
                  f"{row['ms']:9.3f} ms {row['gb_per_s']:9.2f} GB/s {row['tflop_per_s']:8.3f} TFLOP/s"
                  + ("" if err is None else f"  max|err| {err:.2e}"), flush=True)
  out_json = cli.report_path("bench_kernels.json")
  with open(out_json, "w") as f:
    json.dump(dict(platform=platform, device=str(jax.devices()[0].device_kind), rows=rows), f, indent=1)
  print(f"wrote {out_json}")


if __name__ == "__main__":
  cli.run(main)
