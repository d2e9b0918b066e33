"""Mesh equality check: on `--devices` simulated CPU devices (or a real host's accelerators), every `--meshes` entry
gives the same greedy tokens as one device for every `--policies` entry, logits within float32 tolerance, no
compile after warm-up, and the checkpoint restored straight into the mesh's shards equal to the saved weights; with `--chi_square`, sampled continuations in a mesh keep the exact AR distribution.

  python launch/mesh_check.py                                       # the full sweep (tp=2/4/8, dp=2,tp=4)
  python launch/mesh_check.py --meshes='tp=8;dp=2,tp=4' --policies=ar,linear16,overlap --model=tiny

Policies: ar, linear8/16/32 (LinearSS at that block), overlap and adaptive (RecGuide with its regime fixed, so each
is exercised whatever the load), ragged (adaptive on ragged steps, verifies truncated as the B200 table prices
them). Per mesh, one LLM warms up every variant the policies may route to (as a server
does at start-up), then runs each policy; nothing may compile after the warm-up. Writes a JSON report (`--out`);
exit status 1 if any check fails.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_MESHES = flags.DEFINE_string("meshes", "tp=2;tp=4;tp=8;dp=2,tp=4", "Meshes to check, ';'-separated.")
_POLICIES = flags.DEFINE_list("policies", ["ar", "linear8", "linear16", "linear32", "overlap", "adaptive"],
                              "Policies to check.")
_MODEL = flags.DEFINE_enum("model", "bundled", ["bundled", "tiny"], "The bundled checkpoint or a tiny random model.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Simulated CPU devices (sets XLA_FLAGS before jax loads; 0: leave).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 3, "Prompts decoded together per policy.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 24, "Tokens per prompt.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 2, "Requests decoded together (batch buckets 1..this).")
_CHI_SQUARE = flags.DEFINE_string("chi_square", "", "A mesh to run the sampling chi-square test in ('' : skip).")
_SAMPLES = flags.DEFINE_integer("samples", 1000, "Samples of the chi-square test.")
_LAYER_LOOP = flags.DEFINE_enum("layer_loop", "auto", ["auto", "scan", "unrolled"],
                                "serve.py's --layer_loop (auto: scan on CPU meshes; GPU meshes run unrolled).")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Write the JSON report to <output_dir>/mesh_check.json.")

PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
           "What is 12 * 7?", "Tom has 3 apples and buys 5 more. How many apples does he have?",
           "A train travels 60 miles per hour for 3 hours."]


def _policy(name: str, tables=None):
  from recguide_jax.decoding.registry import make_strategy
  if name == "ar":
    return make_strategy("ar")
  if name.startswith("linear"):
    return make_strategy("linear", int(name[len("linear"):]))
  if name in ("overlap", "adaptive", "ragged"):
    kwargs = {"fixed_regime": name}
    if name == "ragged":  # adaptive blocks on ragged steps, verifies truncated as the B200 table prices them
      from recguide_jax.recguide.profile import load_profile
      kwargs = {"fixed_regime": "adaptive", "verify_truncation": True, "profile": load_profile("b200_nld8b"),
                "calibrate": False}
    if tables is not None:
      kwargs["tables"] = tables
    return make_strategy("recguide", 16, **kwargs)
  raise ValueError(f"--policies: unknown {name!r}")


def _step_kinds(name: str, tables=None) -> tuple:
  """The step kinds policy `name` routes to (ragged steps' own for "ragged")."""
  return tuple(_policy(name, tables).step_kinds()) + (("ragged",) if name == "ragged" else ())


def _model_and_prompts():
  import numpy as np
  from flax import nnx

  from recguide_jax.model import checkpoint
  from recguide_jax.model.config import NLDConfig
  from recguide_jax.llm import BUNDLED_CHECKPOINT, recguide_defaults
  from recguide_jax.model.nld import NLDModel
  from recguide_jax.text.tokenizer import Tokenizer
  if _MODEL.value == "bundled":
    tok = Tokenizer.from_dir(BUNDLED_CHECKPOINT)
    prompts = [tok.encode(p) for p in (PROMPTS * 4)[:_NUM_PROMPTS.value]]
    return (checkpoint.load_model(BUNDLED_CHECKPOINT), prompts,
            recguide_defaults(BUNDLED_CHECKPOINT).get("tables"))
  cfg = NLDConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=8, mask_token_id=3, bos_token_id=1, eos_token_ids=(2,),
                  original_max_position_embeddings=256, rope_factor=4.0, block_size=16, lora_rank=8, lora_alpha=16.0)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(4, cfg.vocab_size, int(rng.integers(5, 20)))) for _ in range(_NUM_PROMPTS.value)]
  return NLDModel(cfg, rngs=nnx.Rngs(1)), [[int(t) for t in p] for p in prompts], None


def _llm(model, mesh):
  from recguide_jax import LLM
  return LLM(model=model, policy="ar", max_num_seqs=_MAX_NUM_SEQS.value, max_model_len=160, page_size=16,
             prefill_chunk=32, block_sizes=(8, 16, 32), warmup=False, compile_cache_dir=None, mesh=mesh,
             layer_loop=_LAYER_LOOP.value)


def _generate(llm, name, prompts, tables):
  from recguide_jax import SamplingParams
  llm.set_policy(_policy(name, tables))
  llm.engine.bucketing = "ragged" if name == "ragged" else "auto"
  try:
    outs = llm.generate(prompts, SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
  finally:
    llm.engine.bucketing = "auto"
  return [list(o.outputs[0].token_ids) for o in outs]


def _logits_gap(model, mesh) -> float:
  """Max |logits(mesh) - logits(one device)| of one causal forward writing a fresh cache, over the first group."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from recguide_jax.parallel import data_parallel

  from recguide_jax.parallel import sharding
  from recguide_jax.cache.kv_cache import KVCache
  from pallas_kernels.common import causal_mask
  from recguide_jax.model.nld import ForwardInputs, shard_model
  b, q = 2, 16
  rng = np.random.default_rng(1)
  inp = dict(tokens=rng.integers(4, model.cfg.vocab_size, (b, q)).astype(np.int32),
             positions=np.broadcast_to(np.arange(q, dtype=np.int32), (b, q)).copy(),
             block_mask=causal_mask(q), prefix_len=np.zeros((b,), np.int32),
             page_table=np.asarray([[1, 2], [3, 4]], np.int32), kv_write=np.ones((b, q), bool),
             lora_mask=np.ones((b, q), bool))

  def run(m, group):
    graphdef, state = nnx.split(m)
    cfg = m.cfg
    cache = KVCache.create(cfg.num_hidden_layers, 8, 16, cfg.num_key_value_heads, cfg.head_dim,
                           sharding=None if group is None else sharding.cache_sharding(group, cfg.num_key_value_heads))
    f = jax.jit(lambda s, c, i: nnx.merge(graphdef, s)(ForwardInputs(**i), c)[0])
    with sharding.mesh_context(group):
      return np.asarray(f(state, cache, jax.tree.map(jnp.asarray, inp) if group is None else
                          jax.device_put(inp, sharding.replicated(group))))

  group = data_parallel.first_group(mesh)
  return float(np.max(np.abs(run(shard_model(model, group), group) - run(model, None))))


def _restore_check(model, mesh) -> dict:
  """Saves `model`, restores it with `load_model(mesh=first group)` (orbax reads each tensor straight into its
  shards) and compares every tensor with the in-memory one (KV projections after their head replication); also
  checks each restored tensor sits on the sharding the rules give."""
  import tempfile

  import jax
  import numpy as np
  from flax import nnx

  from recguide_jax.model import checkpoint

  from recguide_jax.parallel import data_parallel
  from recguide_jax.model.params import flatten_params

  from recguide_jax.parallel import sharding
  group = data_parallel.first_group(mesh)
  with tempfile.TemporaryDirectory() as tmp:
    checkpoint.save_model(tmp, model)
    restored = checkpoint.load_model(tmp, mesh=group)
  ref = flatten_params(nnx.state(model, nnx.Param).to_pure_dict())
  got = flatten_params(nnx.state(restored, nnx.Param).to_pure_dict())
  cfg, run_cfg = model.cfg, restored.cfg
  r = run_cfg.num_key_value_heads // cfg.num_key_value_heads
  gap, placed = 0.0, True
  for name, value in got.items():
    want = np.asarray(ref[name])
    if name in sharding.KV_PROJECTIONS:
      want = np.asarray(sharding.replicate_kv_heads(want, cfg.num_key_value_heads, cfg.head_dim, r))
    gap = max(gap, float(np.max(np.abs(np.asarray(jax.device_get(value)) - want))))
    placed &= value.sharding.is_equivalent_to(sharding.param_sharding_fn(group)(name, value.shape), value.ndim)
  return {"max_abs_diff": gap, "on_rule_shardings": bool(placed), "kv_heads": run_cfg.num_key_value_heads}


def _chi_square(mesh_spec: str, samples: int) -> dict:
  """Sampled continuations of a 6-token-vocabulary model (LinearSS 8, leviathan rule) in the mesh against the exact
  AR distribution computed on one device."""
  import itertools

  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from pallas_kernels.common import causal_mask
  from recguide_jax.benchmarks import stats as bench_stats

  from recguide_jax import LLM

  from recguide_jax import SamplingParams

  from recguide_jax.decoding.builtin import LinearStrategy
  from recguide_jax.runtime import sampling
  from recguide_jax.model.config import NLDConfig
  from recguide_jax.model.nld import ForwardInputs, NLDModel
  vocab, mask, prompt, n = 6, 5, [1, 4, 2], 3
  cfg = NLDConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, mask_token_id=mask, bos_token_id=1,
                  eos_token_ids=(0,), original_max_position_embeddings=64, rope_factor=4.0, block_size=8)
  model = NLDModel(cfg, rngs=nnx.Rngs(3))
  params = SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True)
  conts = list(itertools.product([t for t in range(vocab) if t != mask], repeat=n))
  seqs = jnp.asarray([prompt + list(c) for c in conts])
  logits, _ = model(ForwardInputs(tokens=seqs, positions=jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape),
                                  block_mask=causal_mask(seqs.shape[1])))
  b = len(conts)
  p = np.asarray(sampling.processed_probs(logits, jnp.ones((b,)), jnp.zeros((b,), jnp.int32), jnp.ones((b,)), mask),
                 np.float64)  # float64: scipy wants the observed and expected totals equal to 1.5e-8
  exact = np.array([np.prod([p[i, len(prompt) - 1 + j, t] for j, t in enumerate(c)]) for i, c in enumerate(conts)])
  llm = LLM(model=model, policy=LinearStrategy(8), max_num_seqs=32, max_model_len=32, page_size=4,
            prefill_chunk=4, rule="leviathan", warmup=False, compile_cache_dir=None, mesh=mesh_spec)
  outs = llm.generate([prompt] * samples, [SamplingParams(**{**params.__dict__, "seed": 1000 + i})
                                           for i in range(samples)], use_tqdm=False)
  index = {c: i for i, c in enumerate(conts)}
  observed = np.zeros(len(conts))
  for o in outs:
    observed[index[tuple(o.outputs[0].token_ids)]] += 1
  expected = exact / exact.sum() * samples
  pvalue = bench_stats.pooled_chisquare_pvalue(observed, expected)
  return {"mesh": mesh_spec, "samples": samples, "pvalue": pvalue, "ok": pvalue > 0.001}


def report_path() -> str:
  os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
  return os.path.join(_OUTPUT_DIR.value, "mesh_check.json")


def main(argv) -> int:
  del argv
  from recguide_jax.parallel import multihost as distributed
  distributed.simulate_cpu_devices(_DEVICES.value)
  import jax
  model, prompts, tables = _model_and_prompts()
  report = {"devices": len(jax.devices()), "model": _MODEL.value, "max_tokens": _MAX_TOKENS.value,
            "num_prompts": len(prompts), "meshes": {}, "ok": True}
  meshes = [s for s in _MESHES.value.split(";") if s]
  t0 = time.perf_counter()
  base_llm = _llm(model, None) if meshes else None
  base = {name: _generate(base_llm, name, prompts, tables) for name in _POLICIES.value} if meshes else {}
  report["one_device_seconds"] = round(time.perf_counter() - t0, 1)
  kinds = tuple(dict.fromkeys(k for name in _POLICIES.value for k in _step_kinds(name, tables)))
  sizes = tuple(sorted({b for name in _POLICIES.value for b in _policy(name, tables).block_sizes()}))
  for spec in meshes:
    t0 = time.perf_counter()
    llm = _llm(model, spec)
    llm.runner.warmup(kinds, sizes, progress=False)  # every variant the policies may route to, as a server does
    row = {"warmup_seconds": round(time.perf_counter() - t0, 1), "policies": {}}
    jax.config.update("jax_log_compiles", True)  # names anything compiled after warm-up in the log
    for name in _POLICIES.value:
      row["policies"][name] = {"same_tokens": _generate(llm, name, prompts, tables) == base[name]}
    jax.config.update("jax_log_compiles", False)
    row["compiles_after_warmup"] = llm.runner.compiles_after_warmup
    row["logits_max_abs_diff"] = _logits_gap(model, llm.mesh)
    row["restore"] = _restore_check(model, llm.mesh)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    row["ok"] = (all(p["same_tokens"] for p in row["policies"].values()) and row["compiles_after_warmup"] == 0
                 and row["logits_max_abs_diff"] < 1e-4 and row["restore"]["max_abs_diff"] == 0.0
                 and row["restore"]["on_rule_shardings"])
    report["meshes"][spec] = row
    report["ok"] &= row["ok"]
    print(spec, json.dumps(row), flush=True)
    if _OUTPUT_DIR.value:  # what is done so far survives an interrupted sweep
      with open(report_path(), "w") as f:
        json.dump(report, f, indent=2)
  if _CHI_SQUARE.value:
    report["chi_square"] = _chi_square(_CHI_SQUARE.value, _SAMPLES.value)
    report["ok"] &= report["chi_square"]["ok"]
    print("chi_square", json.dumps(report["chi_square"]), flush=True)
  if _OUTPUT_DIR.value:
    with open(report_path(), "w") as f:
      json.dump(report, f, indent=2)
  print("ok" if report["ok"] else "FAILED", flush=True)
  return 0 if report["ok"] else 1


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli
  cli.run(lambda argv: sys.exit(main(argv)))  # absl's app.run; --help / -h exit 0
