"""Scale-out: mesh specs and flags, the sharding rules of every weight and the KV pages, KV-head replication, the
per-device memory plan, the NLD-8B step lowered for tp=4/8 meshes for cuda and tpu (abstract weights), and on 8
simulated CPU devices (a subprocess: this process's jax already has its devices) the same greedy tokens as one
device for dp=2,tp=4, logits within float32 tolerance and no compile after warm-up. The full sweep (tp=2/4/8 and
dp=2,tp=4 x AR, LinearSS 8/16/32, overlap, adaptive on the bundled model, and the chi-square test of sampling in a
mesh) is `python launch/mesh_check.py` (docs/scale_out.md)."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import COMPILE_FLAGS
from pallas_kernels.common import block_attention_ref, causal_mask
from recguide_jax.attention import dispatch as attention_dispatch
from recguide_jax.model import checkpoint
from recguide_jax.parallel import data_parallel
from recguide_jax.cache import memory_plan
from recguide_jax.parallel import sharding
from recguide_jax.model.config import LORA_TARGET_MODULES, PRESETS
from recguide_jax.model.nld import abstract_model
from recguide_jax.runtime.runner import Runner, RunnerConfig
from recguide_jax.runtime.step_key import StepKey, StepKind
from recguide_jax.runtime.steps import example_inputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = memory_plan.GB


def test_mesh_specs_and_their_errors():
  assert sharding.parse_mesh("dp=2,tp=4") == sharding.MeshShape(dp=2, tp=4)
  assert sharding.parse_mesh("tp=8") == sharding.MeshShape(tp=8)
  assert sharding.parse_mesh(" tp=2 , dp=3 ") == sharding.MeshShape(dp=3, tp=2)
  assert sharding.parse_mesh("") == sharding.MeshShape()
  assert str(sharding.MeshShape(dp=2, tp=4)) == "dp=2,tp=4"
  for bad, match in [("tp=4,xp=2", "unknown axis 'xp'"), ("tp4", "expected 'dp=N,tp=M'"), ("tp=2,tp=4", "twice"),
                     ("tp=0", "positive")]:
    with pytest.raises(sharding.MeshError, match=f"--mesh.*{match}"):
      sharding.parse_mesh(bad)
  with pytest.raises(sharding.MeshError, match="--mesh dp=2,tp=4 needs 8 devices, 1 are available"):
    sharding.make_mesh(sharding.MeshShape(dp=2, tp=4), jax.devices()[:1])


def test_mesh_flags(monkeypatch):
  from absl import flags

  from recguide_jax.parallel import multihost as distributed
  fv = flags.FlagValues()
  monkeypatch.setattr(distributed, "_FLAG_VALUES", None)
  distributed.define_mesh_flags(fv)
  distributed.define_mesh_flags(fv)  # idempotent
  fv(["prog", "--tensor_parallel_size=4", "--data_parallel_size=2"])
  assert distributed.mesh_shape_from_flags() == sharding.MeshShape(dp=2, tp=4)
  assert fv.tensor_parallel_size == 4 and fv.data_parallel_size == 2
  fv.unparse_flags()
  fv(["prog", "--mesh=dp=2,tp=4", "--tensor_parallel_size=8"])
  with pytest.raises(sharding.MeshError, match="--mesh 'dp=2,tp=4' contradicts --tensor_parallel_size 8"):
    distributed.mesh_shape_from_flags()
  fv.unparse_flags()
  fv(["prog"])
  assert distributed.mesh_shape_from_flags() is None and not distributed.initialize_from_flags()
  fv.unparse_flags()
  fv(["prog", "--num_processes=2"])
  with pytest.raises(ValueError, match="--coordinator_address, --num_processes and --process_id together"):
    distributed.initialize_from_flags()


def test_every_weight_has_a_rule_and_the_rules_split_heads_mlp_and_vocab():
  cfg = PRESETS["nld-8b"].replace(lora_rank=128, lora_alpha=512.0,  # a draft LoRA on every projection
                                   lora_target_modules=LORA_TARGET_MODULES)
  shapes = checkpoint.param_shapes(cfg, jnp.bfloat16)
  mesh = sharding.abstract_mesh(sharding.MeshShape(tp=8))
  specs = {name: sharding.param_spec(name, sds.shape, mesh) for name, sds in shapes.items()}
  assert set(specs) == set(sharding.PARAM_AXES)
  tp = sharding.TP
  assert specs["layers.self_attn.q_proj.kernel"] == P(None, None, tp)  # columns: heads
  assert specs["layers.self_attn.k_proj.kernel"] == P(None, None, tp)
  assert specs["layers.self_attn.o_proj.kernel"] == P(None, tp)  # rows: heads
  assert specs["layers.self_attn.o_proj.lora_a"] == P(None, tp)  # the adapter's input rows follow o_proj's
  assert specs["layers.self_attn.o_proj.lora_b"] == P()
  assert specs["layers.self_attn.q_proj.lora_b"] == P(None, None, tp)  # output columns follow q_proj's
  assert specs["layers.mlp.down_proj.lora_a"] == P(None, tp)
  assert specs["layers.mlp.gate_proj.kernel"] == specs["layers.mlp.up_proj.kernel"] == P(None, None, tp)
  assert specs["layers.mlp.down_proj.kernel"] == P(None, tp)
  assert specs["embed_tokens.embedding"] == P(tp)  # vocabulary rows
  assert specs["diffusion_head.kernel"] == P(None, tp)  # vocabulary columns
  assert specs["norm.weight"] == specs["layers.input_layernorm.weight"] == P()
  assert sharding.cache_spec(mesh, 8) == P(None, None, None, tp)  # KV heads of the pages
  # a dimension the mesh axis does not divide stays replicated instead of failing
  assert sharding.param_spec("embed_tokens.embedding", (6, 64), mesh) == P()


def test_kv_heads_replicated_in_groups_when_tp_exceeds_them():
  cfg = PRESETS["nld-8b"]  # 32 query heads, 8 KV heads
  assert sharding.mesh_config(cfg, 8) is cfg
  sixteen = sharding.mesh_config(cfg, 16)  # NLD on a v5e-16: each chip one KV head, 2 query heads
  assert sixteen.num_key_value_heads == 16 and sixteen.num_attention_heads == 32
  with pytest.raises(sharding.MeshError, match="--tensor_parallel_size 3 must divide the model's 8 KV heads"):
    sharding.mesh_config(cfg, 3)
  with pytest.raises(sharding.MeshError, match="--tensor_parallel_size 64 must divide the model's 32 attention heads"):
    sharding.mesh_config(cfg, 64)
  # the replicated model computes the same attention: GQA maps query head j to KV head j // (Hq / Hkv) either way
  rng = np.random.default_rng(0)
  b, q, hq, hkv, d, r = 2, 5, 8, 2, 16, 4
  qs, ks, vs = (jnp.asarray(rng.normal(size=(b, q, h, d)), jnp.float32) for h in (hq, hkv, hkv))
  mask = causal_mask(q)
  expand = lambda x: sharding.replicate_kv_heads(x.reshape(b, q, hkv * d), hkv, d, r).reshape(b, q, hkv * r, d)
  one = block_attention_ref(qs, ks, vs, mask, scale=d ** -0.5)
  rep = block_attention_ref(qs, expand(ks), expand(vs), mask, scale=d ** -0.5)
  np.testing.assert_allclose(np.asarray(rep), np.asarray(one), rtol=1e-6, atol=1e-6)


def test_memory_plan_per_device_of_a_mesh():
  plan = lambda preset, gb, tp: memory_plan.plan_memory(
      PRESETS[preset], dtype="bfloat16", page_size=16, max_model_len=8192, max_num_seqs=32, max_block=64,
      device="stated", device_bytes=int(gb * GB), fraction=0.9, tp=tp)
  with pytest.raises(memory_plan.MemoryPlanError, match="weights 16.98 GB exceed"):
    plan("nld-8b", 16, 1)  # one v5e chip
  four = plan("nld-8b", 16, 4)  # 4x v5e: a quarter of the weights and of the KV heads per chip
  assert 4.24 * GB < four.weights_bytes < 4.25 * GB and four.max_seqs_at_max_len >= 8
  assert plan("nld-14b", 24, 2).weights_bytes < 13.6 * GB  # 2x 24 GB GPUs hold the 14B
  with pytest.raises(memory_plan.MemoryPlanError, match=r"per device, tp=2"):
    plan("nld-14b", 12, 2)


@pytest.mark.parametrize("tp", [4, 8])
@pytest.mark.parametrize("platform,kernel_call", [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")])
def test_nld8b_step_lowers_on_a_tp_mesh(tp, platform, kernel_call):
  """NLD-8B verify step (B = 16, batch 8, 8192-token page tables) from abstract bf16 weights on an abstract tp mesh:
  the weights, KV pages and logits carry their tp shardings into the lowered module and the Pallas kernel runs per
  shard (inside a manual computation over the local heads)."""
  amesh = sharding.abstract_mesh(sharding.MeshShape(tp=tp))
  model = abstract_model(PRESETS["nld-8b"], amesh, attention_impl="pallas")
  rc = RunnerConfig(num_pages=1100, page_size=16, max_model_len=8192, max_batch=8, block_sizes=(16,))
  runner = Runner(model, rc, mesh=amesh, cache_sharding=sharding.cache_sharding(amesh, model.cfg.num_key_value_heads))
  key = StepKey(StepKind.VERIFY, 16, 8)
  inputs = example_inputs(key, rc.pages_per_seq, model.cfg.vocab_size)
  with attention_dispatch.target_platform(platform), sharding.mesh_context(amesh):
    traced = runner._jit(key, inputs).trace(runner._weights_spec, runner._cache_spec, inputs)
  try:
    text = traced.lower(lowering_platforms=(platform,)).as_text()
  except ValueError as e:
    if "Unsupported TPU device kind" in str(e):  # a lowering rule asked for chip info no CPU host has
      pytest.skip(str(e))
    raise
  assert kernel_call in text
  assert "sdy.manual_computation" in text  # shard_map: the kernel sees its shard's heads only
  assert re.search(r'sdy\.sharding<@mesh, \[\{\}, \{\}, \{\}, \{"tp"\}\]>', text)  # KV pages: whole heads split
  assert re.search(r'sdy\.sharding<@mesh, \[\{"tp"\}, \{\}\]>', text)  # the embedding: vocabulary rows


def test_runner_without_mesh_is_unchanged():
  # a plain runner resolves to no mesh and no sharding constraint: the one-device programs are the same as before
  assert data_parallel.resolve_mesh(None) is None and data_parallel.first_group(None) is None
  assert sharding.active_mesh() is None
  x = jnp.ones((2, 3))
  assert sharding.constrain(x, "batch", "act_embed") is x


_UNROLLED_ON_A_MESH = """
import json, sys
sys.path.insert(0, {tests!r})
import jax
from flax import nnx
from conftest import tiny_config
from recguide_jax import LLM, SamplingParams
from recguide_jax.model.nld import NLDModel
from recguide_jax.parallel import sharding
model = NLDModel(tiny_config(), rngs=nnx.Rngs(1))
prompts = [[5, 9, 14, 3, 77], [40, 41, 42]]
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
out = {{}}
for name, kw in (("one", {{}}), ("tp2", {{"mesh": "tp=2", "layer_loop": "unrolled"}})):
  llm = LLM(model=model, policy="linear", block_size=8, max_num_seqs=2, max_model_len=64, page_size=8,
            prefill_chunk=16, warmup=False, compile_cache_dir=None, **kw)
  out[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
  if name == "tp2":
    out["loop"] = llm.runner.layer_loop.value
    out["specs"] = {{sharding._path_name(p): str(x.sharding.spec) for p, x in
                    jax.tree_util.tree_flatten_with_path(llm.runner.state)[0]
                    if sharding._path_name(p).startswith("layers.1.") and sharding._path_name(p).endswith("kernel")}}
print(json.dumps(out))
"""


def test_unrolled_layers_on_a_tp_mesh_keep_their_shardings_and_tokens():
  """The unrolled layer loop (a GPU mesh's default: XLA:GPU copies the weight slices a scan takes) on 2 simulated
  CPU devices at tp=2: each layer's weights sit on the stacked rule without the layer axis, and greedy LinearSS
  gives one device's tokens."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = COMPILE_FLAGS + " --xla_force_host_platform_device_count=2"
  proc = subprocess.run([sys.executable, "-c", _UNROLLED_ON_A_MESH.format(tests=os.path.join(REPO, "tests"))],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["loop"] == "unrolled" and out["tp2"] == out["one"]
  specs = out["specs"]
  assert specs["layers.1.self_attn.q_proj.kernel"] == "P(None, 'tp')"
  assert specs["layers.1.mlp.down_proj.kernel"] == "P('tp',)"


def test_mesh_equality_on_eight_cpu_devices(tmp_path):
  """dp=2,tp=4 on 8 simulated CPU devices (two groups of 4, each with the tiny model's 2 KV heads replicated 2x):
  greedy AR, LinearSS 8 and ragged steps (RecGuide's adaptive blocks, verifies truncated) give the tokens of one
  device, logits within 1e-4, nothing compiles after warm-up, and
  a checkpoint restored with `load_model(mesh=...)` lands in its shards with the saved values.
  Kept small (every variant compiles once per group); the sweep over tp=2/4/8 and dp=2,tp=4, LinearSS 8/16/32,
  overlap, adaptive and the chi-square test is `launch/mesh_check.py` (docs/scale_out.md)."""
  out = tmp_path / "mesh_check.json"  # in --output_dir
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = COMPILE_FLAGS  # the session's compile options; mesh_check adds its device count
  proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "mesh_check.py"), "--model=tiny",
                         "--meshes=dp=2,tp=4", "--policies=ar,linear8,ragged", "--max_num_seqs=1", "--num_prompts=2",
                         "--max_tokens=10", f"--output_dir={tmp_path}"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["devices"] == 8 and report["ok"]
  row = report["meshes"]["dp=2,tp=4"]
  assert row["policies"] == {"ar": {"same_tokens": True}, "linear8": {"same_tokens": True},
                             "ragged": {"same_tokens": True}}
  assert row["compiles_after_warmup"] == 0 and row["logits_max_abs_diff"] < 1e-4
  # the checkpoint restored straight into one group's shards (2 KV heads replicated to 4) equals the saved weights
  assert row["restore"] == {"max_abs_diff": 0.0, "on_rule_shardings": True, "kv_heads": 4}
