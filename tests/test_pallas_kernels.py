"""The Pallas block-attention kernels (`pallas_kernels`), on CPU only:
- both variants in interpret mode against their pure-jnp `_ref` twins over ragged paged prefixes (including 0, page
  boundaries, lengths that are not page multiples and whole page tables), every mask kind the model uses (causal
  verify/prefill, bidirectional draft, packed tree), GQA 1/4/8, fp32/bf16, one layer's pages and all layers stacked
  (`layer=`), small block sizes so the prefix walk takes several steps and GPU rows split, and long prefixes the
  GPU kernel splits across its grid (split-K, partials merged by log-sum-exp);
- the GPU split rule at the 8B model's shapes;
- the kernels per layer of a stacked cache inside a `lax.scan` over layers, the application's K/V scatter
  (`kv_cache.write_block`) between them (how the scanned model calls them);
- lowering of every kernel for its real backend (Triton for cuda, Mosaic for tpu) at 8B shapes with a stacked
  34-layer cache and an 8192-token page table, which jax does without a device;
- the tiny model with the kernels forced on gives the reference path's logits, greedy tokens and cache.
Interpret mode compiles a grid interpreter per shape, so the numeric cases are few and tiny; only lowering uses 8B
shapes.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import block_attention_gpu, block_attention_tpu, common
from recguide_jax.attention import dispatch as attention_dispatch
from recguide_jax.cache.kv_cache import write_block
from recguide_jax.model.nld import ForwardInputs, NLDModel
from tests.conftest import tiny_config

VARIANTS = {"gpu": block_attention_gpu, "tpu": block_attention_tpu}


@dataclasses.dataclass(frozen=True)
class Case:
  nq: int
  hq: int
  hkv: int
  mask: str  # causal | full | tree
  page_size: int
  prefix: tuple[int, ...]  # one ragged prefix length per request
  dtype: str = "float32"
  head_dim: int = 16
  pages_per_seq: int = 4
  small_blocks: bool = False  # several prefix steps per request (and GPU row blocks)
  layers: int = 0  # 0: one layer's pages [N, ps, H * D]; else stacked [layers, N, ps, H * D], read at the last layer
  splits: int | None = None  # GPU prefix splits (None: the rule, which gives 1 at these tiny shapes)


CASES = [
  Case(8, 4, 1, "causal", 8, (0, 8, 13)),  # GQA 4, empty prefix, exact page boundary, ragged tail
  Case(8, 8, 1, "full", 16, (16, 0), small_blocks=True, layers=2),  # GQA 8, diffusion draft, multi-step walk
  Case(12, 4, 4, "tree", 8, (32, 5), small_blocks=True),  # GQA 1, odd tree size, prefix = whole page table
  Case(1, 8, 2, "causal", 8, (7, 24)),  # AR decode
  Case(16, 8, 2, "tree", 16, (20, 48), dtype="bfloat16", small_blocks=True, layers=3),
  Case(20, 4, 1, "causal", 8, (9, 0), dtype="bfloat16"),  # odd causal chunk: padded rows and keys
]

# Long prefixes (relative to the tiny blocks: 13-16 prefix steps of 16 keys), ragged per request including 0 and
# lengths that are not page multiples, split over 3-7 GPU programs; several splits of the short requests are empty.
LONG_CASES = [
  Case(8, 4, 2, "causal", 8, (0, 37, 104, 61), pages_per_seq=13, small_blocks=True, layers=3, splits=4),  # verify
  Case(8, 4, 2, "full", 8, (101, 0, 17), pages_per_seq=13, small_blocks=True, splits=7),  # draft: 1 step per split
  Case(12, 8, 2, "tree", 16, (250, 9), pages_per_seq=16, small_blocks=True, layers=2, splits=3),  # fused tree
]


def make_inputs(case: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  b, d, dtype = len(case.prefix), case.head_dim, jnp.dtype(case.dtype)
  num_pages = b * case.pages_per_seq + 3
  arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  page_table = rng.permutation(np.arange(1, num_pages))[:b * case.pages_per_seq].reshape(b, case.pages_per_seq)
  if case.mask == "tree":
    mask = rng.random((b, case.nq, case.nq)) < 0.35
    mask |= np.eye(case.nq, dtype=bool)  # a tree node always sees itself
    mask = jnp.asarray(mask)
  else:
    mask = case.mask
  lead = (case.layers,) if case.layers else ()
  inp = dict(q=arr(b, case.nq, case.hq, d), k_block=arr(b, case.nq, case.hkv, d),
             v_block=arr(b, case.nq, case.hkv, d), block_mask=mask,
             k_pages=arr(*lead, num_pages, case.page_size, case.hkv * d),
             v_pages=arr(*lead, num_pages, case.page_size, case.hkv * d),
             page_table=jnp.asarray(page_table, jnp.int32), prefix_len=jnp.asarray(case.prefix, jnp.int32),
             scale=d ** -0.5)
  if case.layers:
    inp["layer"] = jnp.int32(case.layers - 1)  # an array, as a scan's layer index is
  return inp


def tolerance(dtype: str) -> float:
  return 1e-5 if dtype == "float32" else 3e-2  # bf16: p is rounded before P @ V, in a different order


def case_id(c: Case) -> str:
  return (f"{c.mask}-q{c.nq}-g{c.hq // c.hkv}-ps{c.page_size}-{c.dtype}" + (f"-L{c.layers}" if c.layers else "")
          + (f"-split{c.splits}" if c.splits else ""))


def run_case(variant: str, case: Case):
  kernel = VARIANTS[variant]
  inp = make_inputs(case)
  kwargs = {}
  if case.small_blocks:
    kwargs["block_sizes"] = common.BlockSizes(block_r=16, block_k=16)
  if variant == "gpu" and case.splits:
    kwargs["num_splits"] = case.splits
  out = kernel.block_attention(**inp, interpret=True, **kwargs)
  ref = kernel.block_attention_ref(**inp)
  assert out.shape == ref.shape and out.dtype == ref.dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tolerance(case.dtype),
                             rtol=tolerance(case.dtype))
  return inp, ref


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_matches_ref(variant, case):
  run_case(variant, case)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", LONG_CASES, ids=case_id)
def test_long_prefix_matches_ref(variant, case):
  """Long ragged prefixes; on GPU split across the grid (`case.splits` programs per row block, each walking its
  page range to a partial softmax, merged by log-sum-exp)."""
  if variant == "gpu":
    inp = make_inputs(case)
    plan = block_attention_gpu.launch_plan(len(case.prefix), case.nq, case.hq, case.hkv, case.page_size,
                                           case.pages_per_seq, common.BlockSizes(16, 16), case.splits)
    assert plan.splits == case.splits > 1  # the case does exercise the split path
  inp, ref = run_case(variant, case)
  if case.layers:  # the stacked twin reads the layer's pages, not another layer's
    single = {k: v for k, v in inp.items() if k != "layer"}
    single["k_pages"], single["v_pages"] = inp["k_pages"][-1], inp["v_pages"][-1]
    np.testing.assert_array_equal(block_attention_gpu.block_attention_ref(**single), ref)
    single["k_pages"], single["v_pages"] = inp["k_pages"][0], inp["v_pages"][0]
    assert not np.allclose(block_attention_gpu.block_attention_ref(**single), ref)


def test_gpu_split_rule_at_8b_shapes():
  """The static split count: enough programs for ~2 per SM of an H200 (`common.GPU_TARGET_PROGRAMS`), at least
  `GPU_MIN_KEYS_PER_SPLIT` keys per split, none when the batch fills the grid; splits cover the whole table."""
  plan = lambda b, nq, pages, **kw: block_attention_gpu.launch_plan(b, nq, 32, 8, 16, pages, **kw)
  one = plan(1, 1, 512)  # one decode request, 8192-token table: 8 programs without splits
  assert (one.splits, one.programs * 8) == (32, 256)
  assert plan(8, 1, 512).splits == 5  # 64 programs -> 5 splits of 13 steps
  assert plan(8, 16, 512).splits == 5  # LinearSS verify B = 16
  assert plan(64, 1, 512).splits == 1  # 512 programs already
  assert plan(1, 1, 16).splits == 1  # 256 keys: one split's worth
  assert plan(1, 1, 64).splits == 4  # 1024 keys: 256 per split
  for b, nq, pages in [(1, 1, 512), (3, 8, 100), (2, 32, 1000), (1, 1, 17)]:
    p = plan(b, nq, pages)
    steps = -(-pages // p.ppb)
    assert p.splits * p.steps_per_split >= steps > (p.splits - 1) * p.steps_per_split  # no empty trailing split
  assert plan(1, 1, 512, num_splits=1).splits == 1  # the single-pass kernel
  assert plan(1, 1, 24, num_splits=100).splits == 3  # at most one block_k step per split
  with pytest.raises(ValueError, match="num_splits"):
    plan(1, 1, 24, num_splits=0)


def test_tpu_kernel_under_tpu_interpreter():
  """The TPU-semantics interpreter (SMEM scalar prefetch, VMEM blocks, DMA) agrees with the generic one, on a
  stacked cache."""
  inp = make_inputs(dataclasses.replace(CASES[2], layers=2), seed=1)
  out = block_attention_tpu.block_attention(**inp, interpret=pltpu.InterpretParams(),
                                            block_sizes=common.BlockSizes(block_r=0, block_k=16))
  np.testing.assert_allclose(out, block_attention_tpu.block_attention_ref(**inp), atol=1e-5, rtol=1e-5)


def test_no_prefix():
  """Without a page table (no cache) only the block's own keys are attended."""
  inp = make_inputs(CASES[0])
  for k in ("k_pages", "v_pages", "page_table", "prefix_len"):
    inp.pop(k)
  ref = block_attention_gpu.block_attention_ref(**inp)
  for kernel in VARIANTS.values():
    np.testing.assert_allclose(kernel.block_attention(**inp, interpret=True), ref, atol=1e-5, rtol=1e-5)


def test_layout_errors():
  inp = make_inputs(CASES[0])
  with pytest.raises(ValueError, match=r"k_pages must be \[layers"):
    block_attention_gpu.block_attention(**inp, layer=0, interpret=True)
  inp = make_inputs(dataclasses.replace(CASES[0], layers=2))
  with pytest.raises(ValueError, match="layer=2 out of range"):
    block_attention_tpu.block_attention(**{**inp, "layer": 2}, interpret=True)
  inp.pop("layer")
  with pytest.raises(ValueError, match=r"k_pages must be \[num_pages"):
    block_attention_gpu.block_attention_ref(**inp)


def _scan_layers(attend, write, q, kb, vb, k_pages, v_pages, page_table, prefix_len, positions):
  """What the scanned model does per layer: attend over layer i's prefix, write the block into layer i, with the
  stacked cache as the scan carry and i an int32 scalar."""
  def body(carry, xs):
    k_pages, v_pages = carry
    i, q, kb, vb = xs
    out = attend(q, kb, vb, "causal", k_pages=k_pages, v_pages=v_pages, page_table=page_table,
                 prefix_len=prefix_len, scale=0.25, layer=i)
    k_pages, v_pages = write(k_pages, v_pages, kb, vb, page_table, positions, jnp.ones(positions.shape, bool),
                             layer=i)
    return (k_pages, v_pages), out
  layers = jnp.arange(k_pages.shape[0], dtype=jnp.int32)
  return jax.lax.scan(body, (k_pages, v_pages), (layers, q, kb, vb))


def test_kernels_in_scan_over_stacked_layers():
  """The GPU kernel inside `lax.scan` over a 3-layer stacked cache (interpreted) == its twin, per layer, with the
  application's scatter writing each layer's block between the reads."""
  rng = np.random.default_rng(5)
  L, b, nq, hq, hkv, d, ps, pages_per_seq = 3, 2, 8, 4, 2, 16, 8, 5
  n = b * pages_per_seq + 1
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  page_table = jnp.asarray(rng.permutation(np.arange(1, n)).reshape(b, pages_per_seq), jnp.int32)
  prefix_len = jnp.asarray([13, 24], jnp.int32)
  args = (f(L, b, nq, hq, d), f(L, b, nq, hkv, d), f(L, b, nq, hkv, d), f(L, n, ps, hkv * d), f(L, n, ps, hkv * d),
          page_table, prefix_len, prefix_len[:, None] + jnp.arange(nq)[None])
  attend = lambda *a, **k: block_attention_gpu.block_attention(*a, **k, interpret=True, num_splits=2,
                                                               block_sizes=common.BlockSizes(16, 16))
  (k_ker, v_ker), out_ker = jax.jit(lambda *a: _scan_layers(attend, write_block, *a))(*args)
  (k_ref, v_ref), out_ref = _scan_layers(block_attention_gpu.block_attention_ref, write_block, *args)
  np.testing.assert_allclose(out_ker, out_ref, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(k_ker, k_ref)
  np.testing.assert_array_equal(v_ker, v_ref)


# ---- lowering for the real backends (no device needed) ------------------------------------------------------------

SDS = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
# NLD-8B: 34 layers, 32 query heads, 8 KV heads, head_dim 128, 16-token pages; an 8192-token page table
L8B, HQ8B, HKV8B, D8B, PS8B, P8B, N8B = 34, 32, 8, 128, 16, 512, 1100


def _lower(fn, platform, *args, **static):
  try:
    return fn.trace(*args, **static).lower(lowering_platforms=(platform,)).as_text()
  except ValueError as e:
    if "Unsupported TPU device kind" in str(e):  # a lowering rule asked for chip info no CPU host has
      pytest.skip(str(e))
    raise


def _lower_attention(variant, platform, mask, nq, b=2, stacked=True):
  pages = SDS(((L8B,) if stacked else ()) + (N8B, PS8B, HKV8B * D8B), BF16)
  blk = lambda h: SDS((b, nq, h, D8B), BF16)
  return _lower(VARIANTS[variant]._attention, platform, blk(HQ8B), blk(HKV8B), blk(HKV8B),
                SDS((b, nq, nq), bool) if mask == "tree" else None, pages, pages, SDS((b, P8B), jnp.int32),
                SDS((b,), jnp.int32), SDS((), jnp.int32) if stacked else None, mask_kind=mask, scale=D8B ** -0.5,
                interpret=False, block_sizes=None)


def _triton_grid(text: str) -> int:
  (x, y, z), = re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32", text)
  return int(x) * int(y) * int(z)


@pytest.mark.parametrize("variant,platform,custom_call",
                         [("gpu", "cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")])
@pytest.mark.parametrize("mask,nq", [("causal", 1), ("full", 32), ("tree", 37)])
def test_kernels_lower_for_their_backend(variant, platform, custom_call, mask, nq):
  """8B shapes (34 stacked layers, 32 q heads, 8 KV heads, head_dim 128, bf16, 16-token pages, 8192-token page
  tables): the Triton / Mosaic lowering rules accept every kernel (compiling the result needs the device, see
  docs/kernels.md), and the stacked cache enters them whole (no per-layer slice)."""
  text = _lower_attention(variant, platform, mask, nq)
  assert custom_call in text and "dynamic_slice" not in text


def test_gpu_kernel_lowers_split_for_one_request():
  """One decode request at 8B shapes launches 8 KV heads x 32 splits = 256 programs (8 without split-K); 64
  requests launch 512 programs unsplit; the single-layer layout lowers too."""
  assert _triton_grid(_lower_attention("gpu", "cuda", "causal", 1, b=1)) == 256
  assert _triton_grid(_lower_attention("gpu", "cuda", "causal", 1, b=64)) == 512
  assert "__gpu$xla.gpu.triton" in _lower_attention("gpu", "cuda", "full", 16, stacked=False)


# ---- dispatch and the model --------------------------------------------------------------------------------------


def test_resolve():
  r = attention_dispatch.resolve
  assert r("auto", platform="cpu") == ("reference", None, False)
  assert r("pallas", platform="cpu") == ("pallas", "gpu", True)
  assert r("auto", platform="tpu") == ("pallas", "tpu", False)
  assert r("auto", platform="gpu") == ("pallas", "gpu", False)
  assert r("pallas_tpu", platform="gpu") == ("pallas", "tpu", True)
  assert r("auto", (1, 8, 32, 96), platform="gpu") == ("reference", None, False)  # Triton: head_dim not 2^k
  with pytest.raises(ValueError, match="head_dim"):
    r("pallas", (1, 8, 32, 96), platform="gpu")
  with pytest.raises(ValueError, match="impl"):
    r("triton")


def test_mask_kind_detection():
  assert common.mask_kind_of(jnp.asarray(common.causal_mask(8))) == "causal"  # a concrete jax array too
  assert common.mask_kind_of(np.ones((4, 8, 8), bool)) == "full"
  assert common.mask_kind_of(np.eye(8, dtype=bool)) == "tree"
  assert jax.jit(lambda m: jnp.asarray(common.mask_kind_of(m) == "tree"))(np.ones((8, 8), bool))  # traced


def _model_steps(model, impl: str):
  """Prefill (ragged chunk) -> draft (full block, LoRA off) -> verify (causal, writes) -> tree forward, all through
  the model's own forward; returns every step's logits and the final cache."""
  attention_dispatch.set_attention_impl(model, impl)
  cfg = model.cfg
  rng = np.random.default_rng(11)
  b, ps, pages_per_seq = 2, 8, 6
  cache = model.new_cache(b * pages_per_seq + 1, ps)
  page_table = jnp.asarray(np.arange(1, b * pages_per_seq + 1).reshape(b, pages_per_seq)[:, ::-1].copy())
  tok = lambda *s: jnp.asarray(rng.integers(4, cfg.vocab_size, size=s), jnp.int32)
  logits = []
  # prefill 16-token chunk; row 0 has 11 valid tokens
  zero = jnp.zeros((b,), jnp.int32)
  valid = jnp.arange(16)[None, :] < jnp.asarray([11, 16])[:, None]
  inp = ForwardInputs(tokens=tok(b, 16), positions=jnp.broadcast_to(jnp.arange(16), (b, 16)),
                      block_mask=common.causal_mask(16), prefix_len=zero, page_table=page_table,
                      kv_write=valid)
  out, cache = model(inp, cache)
  logits.append(out)
  prefix = jnp.asarray([11, 16], jnp.int32)
  pos = prefix[:, None] + jnp.arange(8)[None, :]
  draft = tok(b, 8).at[:, 1:].set(cfg.mask_token_id)
  out, _ = model(ForwardInputs(tokens=draft, positions=pos, block_mask=jnp.ones((8, 8), bool), prefix_len=prefix,
                               page_table=page_table), cache)
  logits.append(out)
  verify = jnp.argmax(out, axis=-1).astype(jnp.int32)
  out, cache = model(ForwardInputs(tokens=verify, positions=pos, block_mask=common.causal_mask(8),
                                   prefix_len=prefix, page_table=page_table,
                                   kv_write=jnp.ones((b, 8), bool)), cache)
  logits.append(out)
  tree = jnp.asarray(np.tril(rng.random((b, 8, 8)) < 0.5) | np.eye(8, dtype=bool))
  out, _ = model(ForwardInputs(tokens=tok(b, 8), positions=pos + 8, block_mask=tree, prefix_len=prefix + 8,
                               page_table=page_table), cache)
  logits.append(out)
  return logits, cache


@pytest.fixture(scope="module")
def tiny_reference_steps():
  return _model_steps(NLDModel(tiny_config(), rngs=nnx.Rngs(7)), "reference")


@pytest.mark.parametrize("impl", ["pallas", "pallas_tpu"])  # on CPU: the Triton / Mosaic variant, interpreted
def test_tiny_model_kernels_match_reference(tiny_reference_steps, impl):
  model = NLDModel(tiny_config(), rngs=nnx.Rngs(7))
  ref_logits, ref_cache = tiny_reference_steps
  ker_logits, ker_cache = _model_steps(model, impl)
  for ref, ker in zip(ref_logits, ker_logits):
    np.testing.assert_allclose(ker, ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(jnp.argmax(ker, -1), jnp.argmax(ref, -1))  # same greedy tokens
  ref_leaves, ker_leaves = jax.tree.leaves(ref_cache), jax.tree.leaves(ker_cache)  # either cache layout
  assert len(ref_leaves) == len(ker_leaves)
  for ref, ker in zip(ref_leaves, ker_leaves):
    np.testing.assert_allclose(ker, ref, atol=1e-5, rtol=1e-5)
