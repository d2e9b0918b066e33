"""Measures the hardware profile T_C(B) (docs/spec/recguide.md §5.3) on the current JAX backend with our Runner and
writes a "recguide-profile/1" JSON for launch/fit_tables.py and the regime switch.

For every batch bucket C up to --max_num_seqs (or those --concurrency names) and every B, with every variant compiled
first (--compile_workers at once): the median over --repeats (after --warmup untimed runs) of one draft + one
verify forward for a full bucket of C requests at --prefix_len committed tokens, timed around
`jax.block_until_ready`; AR decode per token (one call of --decode_steps steps, as the engine runs AR, divided by its
steps); and, when the runner has a fused verify+branches step (`Runner.fused`), one fused forward over a full tree
(4B query tokens per request). Only the device steps are timed: no prefill, no host-side batch assembly, no
scheduling (the B200 protocol times graph replays only).

The KV contents are whatever the cache holds (zeros): attention reads every page of the page table whatever the
values, so the cost depends on the prefix length (through max_model_len, set to --prefix_len + the largest block),
not on the tokens.

  python launch/profile.py --max_num_seqs 128 --name h200_nld8b --output_dir docs   # docs/profile_h200_nld8b.json
  python launch/profile.py --shape nld-8b --concurrency 1,4,16,64 --compile_workers 12   # random weights, 4 levels
  python launch/profile.py --random_tiny --max_num_seqs 8                            # CPU smoke run (~1-2 min)

The profile goes to --output_dir/profile_<--name, else the backend>.json (default --output_dir: runs/profile).
"""

import os
import sys

if __name__ == "profile":
  # `python launch/<any script>.py` puts launch/ first on sys.path, where this file shadows the stdlib `profile`
  # module (flax imports IPython, which imports cProfile, which imports profile). Imported under that name, this
  # file hands over to the real module: it loads the stdlib file and replaces itself in sys.modules, which the
  # import system then returns to the importer.
  import importlib.util
  _spec = importlib.util.spec_from_file_location("profile", os.path.join(os.path.dirname(os.__file__), "profile.py"))
  _stdlib = importlib.util.module_from_spec(_spec)
  sys.modules["profile"] = _stdlib
  _spec.loader.exec_module(_stdlib)

import dataclasses  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

FLAGS = flags.FLAGS


def _define_flags():
  # only when run as a script: imported as the stdlib stand-in, this file must not register flags in its host
  flags.DEFINE_string("model", None, "Checkpoint dir (default: llm.default_checkpoint()).")
  flags.DEFINE_bool("random_tiny", False, "Profile a tiny randomly initialised model instead (tests, smoke runs).")
  flags.DEFINE_enum("shape", None, ["nld-3b", "nld-8b", "nld-14b"],
                    "Profile random weights of this preset instead of a checkpoint: the step costs depend on the "
                    "shapes, not the values (no NLD checkpoint needs to be on the accelerator VM).")
  flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16", "float16"],
                    "Weights, activations and KV cache dtype; auto: the checkpoint's (--random_tiny: float32, "
                    "--shape: bfloat16).")
  flags.DEFINE_integer("max_num_seqs", 128, "Largest batch bucket C; every power-of-two bucket below it is measured.")
  flags.DEFINE_list("concurrency", None, "Measure only these batch buckets C (powers of two; the largest sets "
                    "--max_num_seqs); the regime switch interpolates between them. Default: every bucket.")
  flags.DEFINE_list("block_sizes", ["8", "16", "32"], "Block sizes B.")
  flags.DEFINE_integer("prefix_len", 256, "Committed tokens per request (the attention context of each forward).")
  flags.DEFINE_integer("page_size", 16, "KV page size.")
  flags.DEFINE_integer("repeats", 5, "Timed repeats per point (the median is kept).")
  flags.DEFINE_integer("warmup", 1, "Untimed runs per point before timing (a variant's first run pays one-time "
                       "costs beyond its compile).")
  flags.DEFINE_string("name", "", "Profile name stored in the JSON (e.g. h200_nld8b).")
  from recguide_jax.benchmarks import cli
  cli.define_output_flags("profile")
  flags.DEFINE_string("compile_cache_dir", None, "Persistent XLA compilation cache (speeds up repeated runs).")
  flags.DEFINE_bool("fused", True, "Time the fused verify+branches step when the runner has one.")
  flags.DEFINE_integer("compile_workers", 0, "Variants compiled at once before timing (0: the runner's default).")
  flags.DEFINE_integer("seed", 0, "Seed of the random tokens (and of the tiny model).")
  flags.DEFINE_integer("decode_steps", 4,  # llm.DEFAULT_DECODE_STEPS (not imported here: --help stays light)
                       "AR decode steps per device call, as the engine runs them (LLM(decode_steps)): ar_step_ms is "
                       "one such call divided by its steps.", lower_bound=1)
  from recguide_jax.parallel import multihost as distributed
  distributed.define_mesh_flags()  # --tensor_parallel_size/--mesh: times one group's steps on its tp devices


def _tiny_model(seed: int, dtype: str = "float32"):
  from flax import nnx
  from recguide_jax.model.config import NLDConfig
  from recguide_jax.model.nld import NLDModel
  cfg = NLDConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, mask_token_id=3, bos_token_id=1, eos_token_ids=(2,),
                  original_max_position_embeddings=64, rope_factor=4.0, block_size=8)
  return NLDModel(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(seed))


def _median_ms(fn, repeats: int, warmup: int) -> tuple[float, ...]:
  """Runs fn() -> tuple of per-part seconds; returns the per-part medians in ms, plus the median of their sums."""
  for _ in range(warmup):
    fn()
  runs = [fn() for _ in range(repeats)]
  parts = tuple(statistics.median(r[i] for r in runs) * 1e3 for i in range(len(runs[0])))
  return parts + (statistics.median(sum(r) for r in runs) * 1e3,)


def _tree_branches(blk: int):
  from recguide_jax.recguide import overlap as ov
  return [ov.Branch(ov.CORRECTION, blk // 4, 4), ov.Branch(ov.CORRECTION, blk // 2, 5),
          ov.Branch(ov.CONTINUATION, blk)][:ov.MAX_BRANCHES]


def _fused_inputs(runner, drafted, prefix_len, blk: int):
  """A full RecGuide tree for every row (verifier block + corrections at B/4 and B/2 + continuation = 4B query
  tokens), the largest fused forward the overlap regime runs; laid out by the engine's own `tree_layout`."""
  import numpy as np
  from recguide_jax.recguide import overlap as ov
  branches = _tree_branches(blk)
  rows = [ov.tree_layout(blk, d, branches, int(p), runner.cfg.mask_token_id,
                           head=runner.cfg.draft_head) for d, p in zip(drafted, prefix_len)]
  return tuple(np.stack([r[i] for r in rows]) for i in range(5))  # tokens, positions, mask, lora, write


def main(argv):
  del argv
  import jax
  import numpy as np
  from recguide_jax import llm as llm_lib
  from recguide_jax.benchmarks import cli
  from recguide_jax.recguide.profile import HardwareProfile
  from recguide_jax.runtime.runner import RunnerConfig
  from recguide_jax.runtime.steps import SamplingArrays
  from recguide_jax.runtime.step_key import batch_buckets

  try:
    blocks = sorted({int(b) for b in FLAGS.block_sizes})
  except ValueError:
    sys.exit(f"error: --block_sizes must be integers, got {FLAGS.block_sizes}")
  for name in ("max_num_seqs", "prefix_len", "page_size", "repeats"):
    if getattr(FLAGS, name) < 1:
      sys.exit(f"error: --{name} must be >= 1, got {getattr(FLAGS, name)}")
  if FLAGS.warmup < 1:
    sys.exit("error: --warmup must be >= 1 (a variant's first run pays one-time costs)")
  if not blocks or blocks[0] < 2:
    sys.exit("error: --block_sizes must be >= 2")
  max_num_seqs = FLAGS.max_num_seqs
  levels = batch_buckets(max_num_seqs)
  if FLAGS.concurrency:
    try:
      levels = tuple(sorted({int(c) for c in FLAGS.concurrency}))
    except ValueError:
      sys.exit(f"error: --concurrency must be integers, got {FLAGS.concurrency}")
    max_num_seqs = levels[-1]
    if levels[0] < 1 or not set(levels) <= set(batch_buckets(max_num_seqs)):
      sys.exit(f"error: --concurrency levels must be powers of two (or the largest), got {FLAGS.concurrency}")

  if FLAGS.random_tiny and FLAGS.shape:
    sys.exit("error: pass --random_tiny or --shape, not both")
  if FLAGS.random_tiny:
    dtype = "float32" if FLAGS.dtype == "auto" else FLAGS.dtype
    model, model_name = _tiny_model(FLAGS.seed, dtype), f"random tiny NLD (2 layers, hidden 64, vocab 128, {dtype})"
  elif FLAGS.shape:
    from flax import nnx
    from recguide_jax.model.config import PRESETS
    from recguide_jax.model.nld import NLDModel
    dtype = "bfloat16" if FLAGS.dtype == "auto" else FLAGS.dtype
    model = NLDModel(PRESETS[FLAGS.shape], dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(FLAGS.seed))
    model_name = f"random {FLAGS.shape} ({dtype})"
  else:
    from recguide_jax.model import checkpoint as ckpt_lib
    path = FLAGS.model or llm_lib.default_checkpoint()
    if not os.path.isdir(path):
      sys.exit(f"error: --model {path} is not a directory (pass --model or --random_tiny)")
    model, model_name = ckpt_lib.load_model(path, dtype=None if FLAGS.dtype == "auto" else FLAGS.dtype), str(path)
  max_block = max(blocks)
  rc = RunnerConfig(num_pages=1, page_size=FLAGS.page_size, max_model_len=FLAGS.prefix_len + max_block,
                    max_batch=max_num_seqs, block_sizes=tuple(blocks), prefill_chunk=min(blocks),
                    decode_steps=FLAGS.decode_steps)
  # every bucket row owns its pages (+ the trash page); pages_per_seq comes from the config itself
  rc = dataclasses.replace(rc, num_pages=max_num_seqs * rc.pages_per_seq + 1,
                           compile_cache_dir=FLAGS.compile_cache_dir)
  from recguide_jax.parallel import data_parallel
  from recguide_jax.parallel import multihost as distributed
  mesh = distributed.mesh_from_flags()
  if mesh is None:  # arranged for its layer loop here, so that no stacked copy stays alive beside the runner's
    from recguide_jax.model.nld import LayerLoop, with_layer_loop
    model = with_layer_loop(model, LayerLoop.AUTO)
  runner = data_parallel.build_runners(model, rc, mesh)[0]  # no mesh: Runner(model, rc)
  cfg = runner.cfg
  rng = np.random.default_rng(FLAGS.seed)
  has_fused = FLAGS.fused and hasattr(runner, "fused")
  backend = jax.default_backend()
  devices = jax.devices()
  print(f"backend {backend} ({devices[0].device_kind} x{len(devices)}), buckets {levels}, "
        f"blocks {blocks}, prefix {FLAGS.prefix_len}, fused step: {'yes' if has_fused else 'no'}", flush=True)
  # every variant compiled up front, several at once (XLA compiles outside the GIL): on a large model serial
  # first-call compiles would take most of the run
  t0 = time.perf_counter()
  kinds = ("draft", "verify") + ((f"fused{len(_tree_branches(min(blocks)))}",) if has_fused else ())
  compiled = runner.warmup(kinds, tuple(blocks), progress=False, workers=FLAGS.compile_workers or None,
                           background=False, batches=levels)
  print(f"compiled {len(compiled)} variants in {time.perf_counter() - t0:.1f} s", flush=True)

  device = f"{devices[0].device_kind} x{len(devices)}" if len(devices) > 1 else devices[0].device_kind
  notes = (f"launch/profile.py: median of {FLAGS.repeats} timed runs after {FLAGS.warmup} warm-up run(s) per point; "
           f"full buckets of C requests, {FLAGS.prefix_len} committed tokens each (KV contents not meaningful), "
           f"page size {FLAGS.page_size}; jax {jax.__version__}, {runner.layer_loop.value} layers; timed around "
           f"jax.block_until_ready, device steps only (no prefill, batch assembly or scheduling); draft_verify_ms = "
           f"median of per-run draft + verify sums. ar_step_ms = one AR decode call of {FLAGS.decode_steps} step(s) "
           f"divided by its steps. " +
           ("fused_ms = one Runner.fused forward over a full tree (verifier block + 3 branches, 4B query tokens per "
            "request)." if has_fused else "No fused step was timed (fused_ms absent)."))
  draft_verify, draft_ms, verify_ms, fused_ms, ar_ms = {}, {}, {}, {}, {}

  def save() -> str:
    prof = HardwareProfile(
        draft_verify_ms=draft_verify, source=f"launch/profile.py on {platform.node()}, "
        f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}", backend=backend,
        device=device, model=model_name, notes=notes, name=FLAGS.name, ar_step_ms=ar_ms,
        fused_ms=fused_ms if has_fused else None, draft_ms=draft_ms, verify_ms=verify_ms)
    out = cli.report_path(f"profile_{FLAGS.name or backend}.json")
    prof.save(out)
    return out

  for c in levels:
    # a full bucket: every row is a live request with its own pages and the same committed prefix length
    pps = rc.pages_per_seq
    page_table = (1 + np.arange(c)[:, None] * pps + np.arange(pps)[None, :]).astype(np.int32)
    prefix_len = np.full((c,), FLAGS.prefix_len, np.int32)
    write = np.ones((c,), bool)
    samp = SamplingArrays.greedy(c)
    tokens = lambda shape: rng.integers(4, cfg.vocab_size, shape).astype(np.int32)  # noqa: E731

    def ar_step():  # per token of the engine's AR decode call (one dispatch and read-back per decode_steps)
      seed = tokens((c, 1))
      t0 = time.perf_counter()
      runner.verify(seed, None, write, prefix_len, page_table, samp, steps=FLAGS.decode_steps)
      jax.block_until_ready(runner.cache)
      return ((time.perf_counter() - t0) / FLAGS.decode_steps,)

    ar_ms[c] = _median_ms(ar_step, FLAGS.repeats, FLAGS.warmup)[0]
    draft_verify[c], draft_ms[c], verify_ms[c], fused_ms[c] = {}, {}, {}, {}
    for blk in blocks:
      def round_():
        seed = tokens((c,))
        t0 = time.perf_counter()
        drafted, q, _ = jax.block_until_ready(runner.draft(seed, prefix_len, page_table, blk, samp))
        t1 = time.perf_counter()
        runner.verify(drafted, q, write, prefix_len, page_table, samp)  # returns host arrays: synchronous
        jax.block_until_ready(runner.cache)
        return (t1 - t0, time.perf_counter() - t1)

      d, v, dv = _median_ms(round_, FLAGS.repeats, FLAGS.warmup)
      draft_ms[c][blk], verify_ms[c][blk], draft_verify[c][blk] = d, v, dv
      line = f"C={c:<4} B={blk:<3} draft {d:8.3f} ms  verify {v:8.3f} ms  T {dv:8.3f} ms"
      if has_fused:
        drafted = np.asarray(runner.draft(tokens((c,)), prefix_len, page_table, blk, samp)[0])
        tree = _fused_inputs(runner, drafted, prefix_len, blk)

        def fused():
          t0 = time.perf_counter()
          runner.fused(*tree, prefix_len, page_table, samp, blk)  # returns host arrays: synchronous
          jax.block_until_ready(runner.cache)
          return (time.perf_counter() - t0,)

        fused_ms[c][blk] = _median_ms(fused, FLAGS.repeats, FLAGS.warmup)[0]
        line += f"  fused {fused_ms[c][blk]:8.3f} ms"
      print(line + f"  (AR step {ar_ms[c]:.3f} ms)", flush=True)
    out = save()  # after every bucket: a run cut short still leaves the buckets it measured

  print(f"wrote {out} ({runner.compiles_after_warmup} variants compiled after the warm-up)")


if __name__ == "__main__":
  _define_flags()
  from recguide_jax.benchmarks import cli
  cli.run(main)  # absl's app.run; --help / -h exit 0
