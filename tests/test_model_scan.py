"""The scanned layer stack and its runner: every cache-writing step updates the stacked KV cache in place (no copy
of the cache, whatever its size), AR decode takes no draft distribution, and warm-up compiles variants
concurrently without changing what counts as compiled. The unrolled layer loop (`LayerLoop.UNROLLED`, one GPU's
default and the CPU's for weights larger than the host's cache) computes the same function over per-layer weight
buffers that no step slices. The CPU's dense kernels held [out, in] (`KernelLayout.OUT_IN`) compute the same
function, with the weight on the left of every decode-sized matmul, and so do its fused projections
(`ProjectionFusion.FUSED`: q/k/v and gate/up as one matmul each, a draft LoRA included), which split back to the
checkpoint's form exactly."""

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from flax import nnx
from pallas_kernels.common import causal_mask
from recguide_jax.model.nld import (ForwardInputs, KernelLayout, LayerLoop, NLDModel, kernel_layout_of,
                                    layer_loop_of, resolve_kernel_layout, resolve_layer_loop, shard_model,
                                    with_kernel_layout, with_layer_loop)
from recguide_jax.model.nld import (SWAPPED_MATMUL_MAX_ROWS, Dense, ProjectionFusion, projection_fusion_of,
                                    resolve_projection_fusion, with_projection_fusion)
from recguide_jax.runtime.runner import Runner, RunnerConfig
from recguide_jax.runtime.steps import SamplingArrays
from recguide_jax.runtime.step_key import StepKey, StepKind

CFG = tiny_config(lora_rank=4, lora_alpha=8.0)


def _runner_config(num_pages: int, **kw) -> RunnerConfig:
  return RunnerConfig(num_pages=num_pages, page_size=8, max_model_len=64, max_batch=2, block_sizes=(8,),
                      prefill_chunk=16, compile_cache_dir=None, **kw)


# prefill and RecGuide's fused forward write through the same layer code as verify
@pytest.mark.parametrize("variant,loop", [(("verify", 8, 2), LayerLoop.SCAN), (("decode", 1, 1), LayerLoop.SCAN),
                                          (("draft", 8, 1), LayerLoop.SCAN), (("verify", 8, 2), LayerLoop.UNROLLED)])
def test_steps_never_copy_the_cache(variant, loop):
  """Compiled at two cache sizes, a step's temporaries are the same: nothing cache-sized is materialised (a copy
  of the cache, or of one layer's pages, would grow with num_pages). Writers alias the donated cache to their
  output and touch it only through scatters. fp32: XLA's CPU backend widens a bf16 scatter to f32 (copying the
  operand); accelerators scatter bf16 natively."""
  temps = []
  for pages in (40, 120):
    runner = Runner.abstract(CFG, _runner_config(pages, layer_loop=loop), jnp.float32)
    compiled = runner.lower(StepKey.parse(*variant)).compile()
    stats = compiled.memory_analysis()
    temps.append(stats.temp_size_in_bytes)
    cache_bytes = 2 * CFG.num_hidden_layers * pages * 8 * CFG.num_key_value_heads * CFG.head_dim * 4
    cache_shape = f"f32[{CFG.num_hidden_layers},{pages},8,{CFG.num_key_value_heads},{CFG.head_dim}]"
    hlo = compiled.as_text()
    producers = re.findall(r"= " + re.escape(cache_shape) + r"\{[^}]*\} ([\w-]+)\(", hlo)
    assert "copy" not in producers and "copy-start" not in producers, producers
    if variant[0] == "draft":  # reads only: the cache is an input and nothing cache-shaped is computed
      assert stats.alias_size_in_bytes == 0
      assert set(producers) <= {"parameter", "get-tuple-element", "tuple", "while", "bitcast"}, producers
    else:
      assert stats.alias_size_in_bytes == cache_bytes  # both page arrays updated in place
      assert set(producers) <= {"fusion", "scatter", "dynamic-update-slice", "parameter", "get-tuple-element", "tuple",
                                "while", "bitcast"}
  assert temps[0] == temps[1], f"temporaries grow with the cache: {temps}"


def test_layer_weights_are_stacked_once():
  runner = Runner.abstract(CFG, _runner_config(40), jnp.float32)
  q = runner.state["layers"]["self_attn"]["q_proj"]["kernel"]
  assert q.shape == (CFG.num_hidden_layers, CFG.hidden_size, CFG.num_attention_heads * CFG.head_dim)
  assert runner.cache.k.shape == (CFG.num_hidden_layers, 40, 8, CFG.num_key_value_heads * CFG.head_dim)
  # one layer body in the program: a while loop over the layers, not num_hidden_layers copies of it
  hlo = runner.lower(StepKey.parse("verify", 8, 1)).as_text()
  assert len(re.findall(r"dot_general", hlo)) < 20


@pytest.fixture(scope="module")
def runner(tiny_model):
  return Runner(tiny_model, _runner_config(24))


def test_decode_takes_no_draft_distribution_and_equals_verify(runner):
  cfg = runner.cfg
  lowered = runner.lower(StepKey.parse("decode", 1, 2))
  per_call = lowered.args_info[0][2:]  # after (weights, cache): what is uploaded per step
  shapes = [tuple(x.shape) for x in jax.tree.leaves(per_call)]
  assert len(shapes) == 9 and max(int(np.prod(s)) for s in shapes) <= 2 * runner.config.pages_per_seq, shapes
  tokens = np.array([[5], [9]], np.int32)
  write = np.array([True, True])
  prefix_len = np.array([0, 0], np.int32)
  page_table = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]], np.int32)
  page_table = np.pad(page_table, ((0, 0), (0, runner.config.pages_per_seq - page_table.shape[1])))
  samp = SamplingArrays(np.array([0.0, 1.3], np.float32), np.zeros(2, np.int32), np.ones(2, np.float32),
                        np.array([[0, 11], [0, 12]], np.uint32), np.zeros(2, np.int32))
  cache0 = jax.tree.map(jnp.copy, runner.cache)  # the step donates the cache it is given
  got = runner.verify(tokens, None, write, prefix_len, page_table, samp)
  k_after = np.asarray(runner.cache.k)
  # the old AR path: a verify of one token against an all-zero draft distribution, from the same cache
  runner.cache = cache0
  want = runner.verify(tokens, jnp.zeros((2, 1, cfg.vocab_size), jnp.float32), write, prefix_len, page_table, samp)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.accepted, [1, 1])
  np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=0)
  np.testing.assert_array_equal(np.asarray(runner.cache.k), k_after)


def test_parallel_warmup_compiles_every_variant_once(tiny_model):
  runner = Runner(tiny_model, RunnerConfig(num_pages=24, page_size=8, max_model_len=64, max_batch=1, block_sizes=(8,),
                                           prefill_chunk=16, compile_cache_dir=None))
  seconds = runner.warmup(("verify",), (8,), progress=False, workers=2)
  want = runner.variants(("verify",), (8,))
  assert sorted(seconds) == sorted(want) == [StepKey(StepKind.DECODE, 1, 1), StepKey(StepKind.VERIFY, 8, 1)]
  assert all(v in runner._compiled for v in want)
  assert runner.warmup(("verify",), (8,), progress=False) == {}  # nothing left to compile
  runner.compiled(StepKey.parse("decode", 1, 1))
  assert runner.compiles_after_warmup == 0


# ---- the layer loop ------------------------------------------------------------------------------------------------
def test_layer_loop_resolves_and_round_trips(tiny_model):
  assert layer_loop_of(tiny_model) is LayerLoop.SCAN
  # concrete weights on the CPU, no mesh: unrolled once they exceed the last-level cache
  assert resolve_layer_loop("auto", tiny_model, cache_bytes=1024) is LayerLoop.UNROLLED
  assert resolve_layer_loop("auto", tiny_model, cache_bytes=1 << 30) is LayerLoop.SCAN
  assert resolve_layer_loop("auto", tiny_model) is LayerLoop.SCAN  # a few hundred KB fit any host's cache
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  assert resolve_layer_loop(LayerLoop.AUTO, tiny_model, mesh, cache_bytes=1024) is LayerLoop.SCAN
  abstract = nnx.eval_shape(lambda: NLDModel(CFG))
  assert resolve_layer_loop("auto", abstract, cache_bytes=1024) is LayerLoop.SCAN  # lowers for other devices
  assert Runner.abstract(CFG, _runner_config(8), jnp.float32).layer_loop is LayerLoop.SCAN
  # compiled for GPUs (aot_compile's compile-only devices): unrolled, as XLA:GPU copies a scan's weight slices; a
  # TPU reads the slices in place
  devices = lambda platform, n=1: types.SimpleNamespace(size=n, devices=np.array(
      [types.SimpleNamespace(platform=platform)] * n))
  assert resolve_layer_loop("auto", abstract, devices("gpu")) is LayerLoop.UNROLLED
  assert resolve_layer_loop("auto", abstract, devices("gpu", 2)) is LayerLoop.UNROLLED
  assert resolve_layer_loop("auto", abstract, devices("tpu", 4)) is LayerLoop.SCAN
  # concrete weights: only with room on their devices for the per-layer copy (stats as a GPU reports them)
  from recguide_jax.model import nld
  assert not nld._room_to_unroll(tiny_model, lambda d: {"bytes_limit": 1 << 20, "bytes_in_use": (1 << 20) - 1000})
  assert nld._room_to_unroll(tiny_model, lambda d: {"bytes_limit": 1 << 40, "bytes_in_use": 0})
  assert nld._room_to_unroll(tiny_model)  # a CPU device reports no stats
  with pytest.raises(ValueError, match="layer_loop"):
    RunnerConfig(layer_loop="sideways")

  unrolled = with_layer_loop(tiny_model, LayerLoop.UNROLLED)
  assert layer_loop_of(unrolled) is LayerLoop.UNROLLED and layer_loop_of(tiny_model) is LayerLoop.SCAN
  assert with_layer_loop(unrolled, "unrolled") is unrolled
  stacked = nnx.state(tiny_model.layers, nnx.Param).to_pure_dict()
  first = nnx.state(unrolled.layers[1], nnx.Param).to_pure_dict()
  for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(first)):
    np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b))
  back = nnx.state(with_layer_loop(unrolled, LayerLoop.SCAN).layers, nnx.Param).to_pure_dict()
  jax.tree.map(np.testing.assert_array_equal, back, stacked)
  abstract_unrolled = with_layer_loop(abstract, LayerLoop.UNROLLED)
  q = abstract_unrolled.layers[0].self_attn.q_proj.kernel
  assert q.shape == (CFG.hidden_size, CFG.num_attention_heads * CFG.head_dim)


def test_auto_scans_the_layers_when_the_unrolled_variants_would_pass_the_memory_mapping_limit(
    tiny_model, tmp_path, monkeypatch, caplog):
  from recguide_jax.runtime import compilation
  maps, limit = tmp_path / "maps", tmp_path / "max_map_count"
  maps.write_text("m\n" * 1000)
  limit.write_text("65530\n")
  monkeypatch.setattr(compilation, "MAPPINGS", str(maps))
  monkeypatch.setattr(compilation, "MAX_MAP_COUNT", str(limit))
  room = compilation.mapping_room()
  assert room == 65530 - 6553 - 1000
  fits = room // compilation.variant_mappings(tiny_model.cfg.num_hidden_layers, unrolled=True)
  assert resolve_layer_loop("auto", tiny_model, cache_bytes=1024, variants=fits) is LayerLoop.UNROLLED
  with caplog.at_level("WARNING"):
    assert resolve_layer_loop("auto", tiny_model, cache_bytes=1024, variants=fits + 1) is LayerLoop.SCAN
  assert "vm.max_map_count" in caplog.text and "scanned" in caplog.text
  # asked for by name, or no room to measure (off Linux): as asked, as before
  assert resolve_layer_loop("unrolled", tiny_model, cache_bytes=1024, variants=fits + 1) is LayerLoop.UNROLLED
  monkeypatch.setattr(compilation, "MAPPINGS", str(tmp_path / "absent"))
  assert resolve_layer_loop("auto", tiny_model, cache_bytes=1024, variants=fits + 1) is LayerLoop.UNROLLED


def test_unrolled_layers_compute_the_scanned_function(tiny_model):
  """Same greedy tokens and logprobs (to float rounding) through prefill and AR decode, and the unrolled program
  takes no slice of a layer weight (the copies XLA:CPU makes of a scan's per-layer weights)."""
  runners = {loop: Runner(tiny_model, _runner_config(24, layer_loop=loop))
             for loop in (LayerLoop.SCAN, LayerLoop.UNROLLED)}
  page_table = np.pad(np.array([[1, 2, 3], [4, 5, 6]], np.int32), ((0, 0), (0, 7)))
  samp = SamplingArrays.greedy(2)
  got = {}
  for loop, runner in runners.items():
    tokens = np.array([[5, 6, 7, 8] + [0] * 12, [9, 10, 11, 12] + [0] * 12], np.int32)
    valid = np.zeros((2, 16), bool)
    valid[:, :4] = True
    out = runner.prefill(tokens, valid, np.zeros(2, np.int32), page_table, np.array([3, 3], np.int32), samp)
    steps = [out[0]]
    for i in range(3):
      res = runner.verify(np.asarray(steps[-1]).reshape(2, 1), None, np.ones(2, bool),
                          np.full(2, 4 + i, np.int32), page_table, samp)
      steps.append(res.tokens[:, 0])
      got.setdefault(loop, []).append(res.logprobs)
    got[loop] = (np.stack(steps), np.stack(got[loop]))
  np.testing.assert_array_equal(got[LayerLoop.SCAN][0], got[LayerLoop.UNROLLED][0])
  np.testing.assert_allclose(got[LayerLoop.SCAN][1], got[LayerLoop.UNROLLED][1], atol=2e-5)
  hlo = runners[LayerLoop.UNROLLED].compiled(StepKey.parse("decode", 1, 2)).as_text()
  for weight in (f"f32[{CFG.hidden_size},{CFG.intermediate_size}]", f"f32[{CFG.intermediate_size},{CFG.hidden_size}]"):
    w = re.escape(weight)  # either kernel layout
    sliced = r"%[\w.-]*slice[\w.-]* = " + w + r"|= " + w + r"\{[^}]*\} (?:dynamic-)?slice\("
    assert not re.findall(sliced, hlo)


# ---- the kernel layout ---------------------------------------------------------------------------------------------
def _assert_auto_is_the_cpus_alone(model, resolve, option: str, bad: str, *, cpu, elsewhere):
  """A CPU-tuned weight arrangement: AUTO gives `cpu` for concrete weights on the CPU (and a runner there), and
  `elsewhere` under a mesh (the sharding rules' form) and for abstract weights (lowered for accelerators); a value
  it does not know is refused naming the option. Returns the abstract model."""
  assert resolve("auto", model) is cpu
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  assert resolve(type(cpu).AUTO, model, mesh) is elsewhere
  abstract = nnx.eval_shape(lambda: NLDModel(CFG))
  assert resolve("auto", abstract) is elsewhere
  assert getattr(Runner.abstract(CFG, _runner_config(8), jnp.float32), option) is elsewhere
  assert getattr(Runner(model, _runner_config(8)), option) is cpu
  with pytest.raises(ValueError, match=option):
    RunnerConfig(**{option: bad})
  return abstract


def test_kernel_layout_resolves_and_round_trips(tiny_model):
  assert kernel_layout_of(tiny_model) is KernelLayout.IN_OUT  # as built, loaded and saved
  abstract = _assert_auto_is_the_cpus_alone(tiny_model, resolve_kernel_layout, "kernel_layout", "diagonal",
                                            cpu=KernelLayout.OUT_IN, elsewhere=KernelLayout.IN_OUT)

  out_in = with_kernel_layout(tiny_model, "out_in")
  assert kernel_layout_of(out_in) is KernelLayout.OUT_IN and kernel_layout_of(tiny_model) is KernelLayout.IN_OUT
  assert with_kernel_layout(out_in, KernelLayout.OUT_IN) is out_in
  q = np.asarray(tiny_model.layers.self_attn.q_proj.kernel[...])  # [L, in, out]
  np.testing.assert_array_equal(np.asarray(out_in.layers.self_attn.q_proj.kernel[...]), np.swapaxes(q, -1, -2))
  head = np.asarray(out_in.diffusion_head.kernel[...])
  assert head.shape == (CFG.vocab_size, CFG.hidden_size)
  # LoRA factors, norms and the embedding are not dense layers: shared as they are
  assert out_in.layers.input_layernorm.weight[...] is tiny_model.layers.input_layernorm.weight[...]
  back = with_kernel_layout(out_in, KernelLayout.IN_OUT)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(back, nnx.Param).to_pure_dict(),
               nnx.state(tiny_model, nnx.Param).to_pure_dict())
  # either arrangement composes with the layer loop, in either order
  unrolled = with_layer_loop(out_in, LayerLoop.UNROLLED)
  assert kernel_layout_of(unrolled) is KernelLayout.OUT_IN
  assert unrolled.layers[1].mlp.down_proj.kernel[...].shape == (CFG.hidden_size, CFG.intermediate_size)
  stacked = with_layer_loop(unrolled, LayerLoop.SCAN)
  np.testing.assert_array_equal(np.asarray(stacked.layers.self_attn.q_proj.kernel[...]), np.swapaxes(q, -1, -2))
  abstract_out_in = with_kernel_layout(abstract, KernelLayout.OUT_IN)
  assert abstract_out_in.layers.mlp.gate_proj.kernel.shape == (CFG.num_hidden_layers, CFG.intermediate_size,
                                                               CFG.hidden_size)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_tied_fp32_head_arranged_out_in_keeps_an_in_out_copy_for_one_row(dtype):
  cfg = tiny_config(tie_word_embeddings=True, rope_type="default", llama_4_scaling_beta=0.0, rope_factor=1.0)
  model = NLDModel(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(2))
  out_in = with_kernel_layout(model, KernelLayout.OUT_IN)
  if dtype != jnp.float32:  # (a narrow float's one row is computed as two, with the weight on the left)
    assert not hasattr(out_in, "tied_head_in_out")
    return
  emb = np.asarray(model.embed_tokens.embedding[...])
  np.testing.assert_array_equal(np.asarray(out_in.tied_head_in_out[...]), emb.T)
  for rows in (1, 2):  # the copy, then the swapped product of the embedding itself
    tokens = jnp.asarray(np.random.default_rng(rows).integers(4, cfg.vocab_size, (1, rows)), jnp.int32)
    inp = ForwardInputs(tokens=tokens, positions=jnp.arange(rows)[None], block_mask=causal_mask(rows))
    np.testing.assert_allclose(np.asarray(out_in(inp)[0]), np.asarray(model(inp)[0]), rtol=1e-5, atol=1e-5)
  # never saved nor sharded: the checkpoint's form drops it
  back = with_kernel_layout(out_in, KernelLayout.IN_OUT)
  assert not hasattr(back, "tied_head_in_out")
  jax.tree.map(np.testing.assert_array_equal, nnx.state(back, nnx.Param).to_pure_dict(),
               nnx.state(model, nnx.Param).to_pure_dict())


def _lora_model() -> NLDModel:
  """A model whose draft LoRA covers some of the fused parts (q, v, up) and not others (k, gate), with nonzero B
  matrices (a fresh adapter's are zero: its delta would be nothing to check)."""
  cfg = tiny_config(lora_rank=4, lora_alpha=8.0, lora_target_modules=("q_proj", "v_proj", "o_proj", "up_proj"))
  model = NLDModel(cfg, rngs=nnx.Rngs(3))
  rng = np.random.default_rng(3)
  for layer_module in (model.layers.self_attn.q_proj, model.layers.self_attn.v_proj, model.layers.mlp.up_proj):
    b = layer_module.lora_b
    b.set_value(jnp.asarray(rng.normal(0, 0.05, b.shape), b.dtype))
  return model


def test_projection_fusion_resolves_and_round_trips(tiny_model):
  model = _lora_model()
  assert projection_fusion_of(model) is ProjectionFusion.SEPARATE  # as built, loaded and saved
  abstract = _assert_auto_is_the_cpus_alone(model, resolve_projection_fusion, "projection_fusion", "interleaved",
                                            cpu=ProjectionFusion.FUSED, elsewhere=ProjectionFusion.SEPARATE)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  with pytest.raises(ValueError, match="projection_fusion=fused cannot run under a mesh"):
    resolve_projection_fusion("fused", model, mesh)

  cfg = model.cfg
  q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
  fused = with_projection_fusion(model, "fused")
  assert projection_fusion_of(fused) is ProjectionFusion.FUSED and with_projection_fusion(fused, "fused") is fused
  attn, mlp = fused.layers.self_attn, fused.layers.mlp
  assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")
  assert attn.qkv_proj.kernel.shape == (cfg.num_hidden_layers, cfg.hidden_size, q + 2 * kv)
  assert mlp.gate_up_proj.kernel.shape == (cfg.num_hidden_layers, cfg.hidden_size, 2 * cfg.intermediate_size)
  # the LoRA of the parts that have one, zeros for k_proj's: A side by side, B block-diagonal
  assert attn.qkv_proj.lora_b.shape == (cfg.num_hidden_layers, 3 * cfg.lora_rank, q + 2 * kv)
  np.testing.assert_array_equal(np.asarray(attn.qkv_proj.lora_b[...][:, :4, q:]), 0)
  np.testing.assert_array_equal(np.asarray(attn.qkv_proj.lora_b[...][:, 4:8]), 0)  # k_proj has none
  # back to the checkpoint's form exactly (k_proj and gate_proj without a LoRA again), from either layout and loop
  want = nnx.state(model, nnx.Param).to_pure_dict()
  for arranged in (fused, with_kernel_layout(with_layer_loop(fused, LayerLoop.UNROLLED), KernelLayout.OUT_IN)):
    back = with_kernel_layout(with_layer_loop(with_projection_fusion(arranged, "separate"), LayerLoop.SCAN),
                              KernelLayout.IN_OUT)
    assert not hasattr(back.layers.self_attn.k_proj, "lora_a") and hasattr(back.layers.self_attn.q_proj, "lora_a")
    jax.tree.map(np.testing.assert_array_equal, nnx.state(back, nnx.Param).to_pure_dict(), want)
  abstract_fused = with_projection_fusion(abstract, ProjectionFusion.FUSED)
  assert isinstance(abstract_fused.layers.mlp.gate_up_proj.kernel.get_value(), jax.ShapeDtypeStruct)


@pytest.mark.parametrize("loop", [LayerLoop.SCAN, LayerLoop.UNROLLED])
@pytest.mark.parametrize("layout", [KernelLayout.IN_OUT, KernelLayout.OUT_IN])
def test_fused_projections_compute_the_same_function_with_and_without_the_draft_lora(loop, layout):
  model = _lora_model()
  cfg = model.cfg
  tokens = jnp.asarray(np.random.default_rng(0).integers(4, cfg.vocab_size, (2, 8)), jnp.int32)
  lora_mask = jnp.asarray(np.arange(8)[None, :] >= np.array([[3], [5]]))  # draft tokens after each row's prefix
  inp = ForwardInputs(tokens=tokens, positions=jnp.broadcast_to(jnp.arange(8), tokens.shape),
                      block_mask=causal_mask(8), lora_mask=lora_mask)
  want, _ = model(inp)
  without_lora, _ = model(dataclasses.replace(inp, lora_mask=None))
  assert not np.allclose(np.asarray(want), np.asarray(without_lora), atol=1e-4)  # the LoRA does change the output
  fused = with_kernel_layout(with_projection_fusion(with_layer_loop(model, loop), "fused"), layout)
  got, _ = fused(inp)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loop", [LayerLoop.SCAN, LayerLoop.UNROLLED])
@pytest.mark.parametrize("rows_per_request", [1, 40])  # 2 and 80 matmul rows: the weight on the left, then not
def test_out_in_kernels_compute_the_same_function(tiny_model, loop, rows_per_request):
  assert 2 <= SWAPPED_MATMUL_MAX_ROWS < 80
  tokens = jnp.asarray(np.random.default_rng(0).integers(4, CFG.vocab_size, (2, rows_per_request)), jnp.int32)
  inp = ForwardInputs(tokens=tokens, positions=jnp.broadcast_to(jnp.arange(rows_per_request), tokens.shape),
                      block_mask=causal_mask(rows_per_request))
  want, _ = tiny_model(inp)
  got, _ = with_kernel_layout(with_layer_loop(tiny_model, loop), KernelLayout.OUT_IN)(inp)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8, 80])  # one row (computed as two), the weight on the left, then the right
def test_out_in_bf16_dense_rounds_an_f32_product_and_copies_no_weight_to_f32(rows):
  """An OUT_IN bf16 layer computes what the IN_OUT one does (an f32-accumulated product rounded to bf16), and on
  the CPU it asks for an f32 result so that XLA reads the bf16 weight as it is: no f32 copy of the kernel."""
  dense = Dense(256, 384, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (rows, 256), jnp.bfloat16)
  kernel = dense.kernel[...]
  want = np.asarray(jnp.dot(x, kernel, preferred_element_type=jnp.float32).astype(jnp.bfloat16), np.float32)
  dense.kernel = nnx.Param(kernel.T)  # held [out, in]
  dense.kernel_layout = KernelLayout.OUT_IN
  forward = jax.jit(lambda x: dense(x))
  got = forward(x)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), want)
  if jax.default_backend() == "cpu":
    hlo = forward.lower(x).compile().as_text()
    assert not re.search(r"f32\[384,256\]", hlo), "the bf16 kernel was converted to an f32 copy"


def test_out_in_runner_puts_the_weight_left_of_few_rows_and_right_of_many(tiny_model):
  """The point of OUT_IN: XLA:CPU's GEMM fills its register panels from the left operand, so a decode's matmuls
  take the weight there ([out, rows] results); a prefill chunk of more rows than SWAPPED_MATMUL_MAX_ROWS keeps the
  activations there ([rows, out]). With fused projections a layer runs 4 dense dots (qkv, o, gate_up, down)."""
  runner = Runner(tiny_model, _runner_config(24, layer_loop=LayerLoop.UNROLLED, kernel_layout="out_in",
                                             projection_fusion="fused"))

  def dense_dots(hlo):  # result shapes of the 2-D (unbatched) dots: the dense layers'
    return [(int(m), int(n)) for m, n in re.findall(r"= f32\[(\d+),(\d+)\]\{1,0\} dot\(", hlo)]

  decode = dense_dots(runner.compiled(StepKey.parse("decode", 1, 2)).as_text())
  assert len(decode) == 4 * CFG.num_hidden_layers + 1 and all(n == 2 for _, n in decode), decode
  assert sum(m == 2 * CFG.intermediate_size for m, _ in decode) == CFG.num_hidden_layers
  rows = 48 * 2
  assert rows > SWAPPED_MATMUL_MAX_ROWS
  prefill = dense_dots(runner.compiled(StepKey.parse("prefill", 48, 2)).as_text())
  assert sum(m == rows for m, _ in prefill) == 4 * CFG.num_hidden_layers, prefill  # the head reads 2 rows
  assert not any(n == rows for _, n in prefill), prefill


def test_shard_model_takes_a_model_of_either_kernel_layout(tiny_model):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  sharded = shard_model(with_kernel_layout(with_layer_loop(tiny_model, "unrolled"), "out_in"), mesh)
  assert kernel_layout_of(sharded) is KernelLayout.IN_OUT and layer_loop_of(sharded) is LayerLoop.SCAN
  jax.tree.map(np.testing.assert_array_equal, nnx.state(sharded, nnx.Param).to_pure_dict(),
               nnx.state(tiny_model, nnx.Param).to_pure_dict())


def test_cpu_variants_compile_with_the_memory_scheduler_and_few_rows_with_eigen_dots(tiny_model):
  """Eigen dots for few rows: up to CPU_EIGEN_DOT_MAX_ROWS with the weight on the right (in_out), only the matrix-
  vector products of one row with the weight on the left (out_in, the CPU default), where YNNPACK's were faster."""
  scheduler = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
  eigen = {"xla_cpu_experimental_ynn_fusion_type": ""}
  one, decode, verify = StepKey(StepKind.DECODE, 1, 1), StepKey(StepKind.DECODE, 1, 2), StepKey(StepKind.VERIFY, 8, 2)
  big = StepKey(StepKind.PREFILL, 64, 2)  # 128 query rows: XLA's default dots
  runners = {layout: Runner(tiny_model, _runner_config(24, kernel_layout=layout,
                                                       compiler_options={"xla_cpu_enable_fast_math": False}))
             for layout in ("in_out", "out_in")}
  fast_math = {"xla_cpu_enable_fast_math": False}
  for layout, runner in runners.items():
    assert runner.platform == "cpu"
    assert runner.compiler_options(one) == {**fast_math, **eigen, **scheduler}
    assert runner.compiler_options(big) == {**fast_math, **scheduler}
  assert runners["in_out"].compiler_options(decode) == runners["in_out"].compiler_options(verify) == {
      **fast_math, **eigen, **scheduler}
  assert "ynn_fusion" not in runners["in_out"].compiled(decode).as_text()
  assert runners["out_in"].compiler_options(decode) == runners["out_in"].compiler_options(verify) == {
      **fast_math, **scheduler}
  # bf16 weights: no Eigen dots with the weight on the left, even for one row (Eigen converts them every step)
  bf16 = NLDModel(CFG, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(7))
  narrow = Runner(bf16, _runner_config(24, kernel_layout="out_in"))
  assert narrow.compiler_options(one) == narrow.compiler_options(decode) == scheduler
  narrow_in_out = Runner(bf16, _runner_config(24, kernel_layout="in_out"))
  assert narrow_in_out.compiler_options(one) == {**eigen, **scheduler}
  # a configured value wins over the CPU default
  own = Runner(tiny_model, _runner_config(24, compiler_options={"xla_cpu_experimental_ynn_fusion_type": "x"}))
  assert own.compiler_options(one) == {"xla_cpu_experimental_ynn_fusion_type": "x", **scheduler}


def test_an_xla_without_a_speed_option_compiles_with_its_default_but_a_configured_option_must_exist(caplog):
  """`compile_with_options` drops an option it added for speed when this jaxlib does not know it (the name is in
  the error) and compiles with XLA's default, with a warning; an option the user configured is never dropped."""
  from recguide_jax.runtime.compilation import compile_with_options, variant_compiler_options

  class Lowered:  # an XLA that knows no CPU option but fast math
    def __init__(self):
      self.tried = []

    def compile(self, compiler_options=None):
      self.tried.append(dict(compiler_options or {}))
      unknown = [k for k in (compiler_options or {}) if k != "xla_cpu_enable_fast_math"]
      if unknown:
        raise RuntimeError(f"INVALID_ARGUMENT: No such compile option: '{unknown[0]}'")
      return "compiled"

  opts = variant_compiler_options({"xla_cpu_enable_fast_math": False}, "cpu", 8)
  lowered = Lowered()
  with caplog.at_level("WARNING"):
    assert compile_with_options(lowered, opts, {"xla_cpu_enable_fast_math": False}) == "compiled"
  assert lowered.tried[-1] == {"xla_cpu_enable_fast_math": False} and len(lowered.tried) == 3
  assert "does not take" in caplog.text
  configured = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_DEFAULT"}
  with pytest.raises(RuntimeError, match="xla_cpu_scheduler_type"):
    compile_with_options(Lowered(), variant_compiler_options(configured, "cpu", 8), configured)
  assert variant_compiler_options({}, "gpu", 8) == {}  # accelerators get none of them
