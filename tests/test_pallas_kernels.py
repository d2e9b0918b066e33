"""The Pallas block-attention kernels (`pallas_kernels`), on CPU only:
- both variants in interpret mode against their pure-jnp `_ref` twins over ragged paged prefixes, every mask kind,
  GQA 1/4/8, fp32/bf16, and with small block sizes so the prefix walk and the row split take several steps;
- the fused K/V write against `kv_cache.write_block`;
- lowering of every kernel for its real backend (Triton for cuda, Mosaic for tpu), which jax does without a device;
- the tiny model with the kernels forced on gives the reference path's logits, greedy tokens and cache.
Interpret mode compiles a grid interpreter per shape, so the cases are few and small.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import block_attention_gpu, block_attention_tpu, common, kv_write_gpu, kv_write_tpu
from recguide_jax import attention_dispatch
from recguide_jax.kv_cache import TRASH_PAGE, write_block
from recguide_jax.model import ForwardInputs, NLDModel
from tests.conftest import tiny_config

VARIANTS = {"gpu": (block_attention_gpu, kv_write_gpu), "tpu": (block_attention_tpu, kv_write_tpu)}


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


CASES = [
  Case(8, 4, 1, "causal", 8, (0, 8, 13)),  # GQA 4, empty prefix, exact page boundary, ragged tail
  Case(8, 8, 1, "full", 16, (16, 0), small_blocks=True),  # GQA 8, diffusion draft, multi-step walk
  Case(12, 4, 4, "tree", 8, (32, 5), small_blocks=True),  # GQA 1, odd tree size, prefix = whole page table
  Case(1, 8, 2, "causal", 8, (7, 24)),  # AR decode
  Case(16, 8, 2, "tree", 16, (20, 48), dtype="bfloat16", small_blocks=True),
  Case(20, 4, 1, "causal", 8, (9, 0), dtype="bfloat16"),  # odd causal chunk: padded rows and keys
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
  return dict(q=arr(b, case.nq, case.hq, d), k_block=arr(b, case.nq, case.hkv, d),
              v_block=arr(b, case.nq, case.hkv, d), block_mask=mask,
              k_pages=arr(num_pages, case.page_size, case.hkv, d), v_pages=arr(num_pages, case.page_size, case.hkv, d),
              page_table=jnp.asarray(page_table, jnp.int32), prefix_len=jnp.asarray(case.prefix, jnp.int32),
              scale=d ** -0.5)


def tolerance(dtype: str) -> float:
  return 1e-5 if dtype == "float32" else 3e-2  # bf16: p is rounded before P @ V, in a different order


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.mask}-q{c.nq}-g{c.hq // c.hkv}-ps{c.page_size}-{c.dtype}")
def test_kernel_matches_ref(variant, case):
  kernel = VARIANTS[variant][0]
  inp = make_inputs(case)
  sizes = common.BlockSizes(block_r=16, block_k=16) if case.small_blocks else None
  out = kernel.block_attention(**inp, interpret=True, block_sizes=sizes)
  ref = kernel.block_attention_ref(**inp)
  assert out.shape == ref.shape and out.dtype == ref.dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tolerance(case.dtype),
                             rtol=tolerance(case.dtype))


def test_tpu_kernel_under_tpu_interpreter():
  """The TPU-semantics interpreter (SMEM scalar prefetch, VMEM blocks, DMA) agrees with the generic one."""
  inp = make_inputs(CASES[2], seed=1)
  out = block_attention_tpu.block_attention(**inp, interpret=pltpu.InterpretParams(),
                                            block_sizes=common.BlockSizes(block_r=0, block_k=16))
  np.testing.assert_allclose(out, block_attention_tpu.block_attention_ref(**inp), atol=1e-5, rtol=1e-5)


def test_no_prefix():
  """Without a page table (no cache) only the block's own keys are attended."""
  inp = make_inputs(CASES[0])
  for k in ("k_pages", "v_pages", "page_table", "prefix_len"):
    inp.pop(k)
  ref = block_attention_gpu.block_attention_ref(**inp)
  for kernel, _ in VARIANTS.values():
    np.testing.assert_allclose(kernel.block_attention(**inp, interpret=True), ref, atol=1e-5, rtol=1e-5)


def write_inputs(seed: int, all_write: bool):
  rng = np.random.default_rng(seed)
  b, t, hkv, d, ps, pages_per_seq = 3, 6, 2, 16, 8, 3
  num_pages = b * pages_per_seq + 2
  pages = lambda: jnp.asarray(rng.normal(size=(num_pages, ps, hkv, d)), jnp.float32)
  page_table = rng.permutation(np.arange(1, num_pages))[:b * pages_per_seq].reshape(b, pages_per_seq)
  start = np.array([0, 5, 16])  # block inside one page, across a page boundary, starting on one
  write = np.ones((b, t), bool) if all_write else rng.random((b, t)) < 0.6
  return (pages(), pages(), jnp.asarray(rng.normal(size=(b, t, hkv, d)), jnp.float32),
          jnp.asarray(rng.normal(size=(b, t, hkv, d)), jnp.float32), jnp.asarray(page_table, jnp.int32),
          jnp.asarray(start[:, None] + np.arange(t)[None], jnp.int32), jnp.asarray(write))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("all_write", [True, False])
def test_fused_write_matches_write_block(variant, all_write):
  args = write_inputs(seed=3, all_write=all_write)
  ref_k, ref_v = write_block(*args)
  kv_write = VARIANTS[variant][1]
  new_k, new_v = kv_write.kv_write(jnp.copy(args[0]), jnp.copy(args[1]), *args[2:], interpret=True)
  if all_write:  # no two tokens share a slot: the whole cache is determined
    np.testing.assert_array_equal(new_k, ref_k)
    np.testing.assert_array_equal(new_v, ref_v)
  else:  # several write=False tokens hit the same trash slot, in no defined order (nor in write_block's scatter)
    np.testing.assert_array_equal(new_k[TRASH_PAGE + 1:], ref_k[TRASH_PAGE + 1:])
    np.testing.assert_array_equal(new_v[TRASH_PAGE + 1:], ref_v[TRASH_PAGE + 1:])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_attention_with_fused_write(variant):
  """Verify-style call: attention over the old prefix, then the block's K/V land where write_block puts them."""
  kernel = VARIANTS[variant][0]
  inp = make_inputs(Case(8, 4, 2, "causal", 8, (5, 16)), seed=2)
  positions = inp["prefix_len"][:, None] + jnp.arange(8)[None]
  ref_out = kernel.block_attention_ref(**inp)
  ref_k, ref_v = write_block(inp["k_pages"], inp["v_pages"], inp["k_block"], inp["v_block"], inp["page_table"],
                             positions, jnp.ones(positions.shape, bool))
  inp["k_pages"], inp["v_pages"] = jnp.copy(inp["k_pages"]), jnp.copy(inp["v_pages"])
  out, new_k, new_v = kernel.block_attention(**inp, write_positions=positions, interpret=True)
  np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(new_k, ref_k)
  np.testing.assert_array_equal(new_v, ref_v)


# ---- lowering for the real backends (no device needed) ------------------------------------------------------------


def _lower(fn, platform, *args, **static):
  try:
    return fn.trace(*args, **static).lower(lowering_platforms=(platform,)).as_text()
  except ValueError as e:
    if "Unsupported TPU device kind" in str(e):  # a lowering rule asked for chip info no CPU host has
      pytest.skip(str(e))
    raise


@pytest.mark.parametrize("variant,platform,custom_call",
                         [("gpu", "cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")])
@pytest.mark.parametrize("mask,nq", [("causal", 1), ("full", 32), ("tree", 37)])
def test_kernels_lower_for_their_backend(variant, platform, custom_call, mask, nq):
  """8B shapes (32 q heads, 8 KV heads, head_dim 128, bf16, 16-token pages): the Triton / Mosaic lowering rules
  accept every kernel (compiling the result needs the device, see docs/kernels.md)."""
  kernel, kv_write = VARIANTS[variant]
  sds = jax.ShapeDtypeStruct
  b, hq, hkv, d, ps, p, n, bf16 = 2, 32, 8, 128, 16, 64, 160, jnp.bfloat16
  pages = sds((n, ps, hkv, d), bf16)
  text = _lower(kernel._attention, platform, sds((b, nq, hq, d), bf16), sds((b, nq, hkv, d), bf16),
                sds((b, nq, hkv, d), bf16), sds((b, nq, nq), bool) if mask == "tree" else None, pages, pages,
                sds((b, p), jnp.int32), sds((b,), jnp.int32), mask_kind=mask, scale=d ** -0.5, interpret=False,
                block_sizes=None)
  assert custom_call in text
  text = _lower(kv_write.kv_write, platform, pages, pages, sds((b, nq, hkv, d), bf16), sds((b, nq, hkv, d), bf16),
                sds((b, p), jnp.int32), sds((b, nq), jnp.int32), sds((b, nq), bool))
  assert custom_call in text


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
  assert common.mask_kind_of(jnp.tril(jnp.ones((8, 8), bool))) == "causal"
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
                      block_mask=jnp.tril(jnp.ones((16, 16), bool)), prefix_len=zero, page_table=page_table,
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
  out, cache = model(ForwardInputs(tokens=verify, positions=pos, block_mask=jnp.tril(jnp.ones((8, 8), bool)),
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
  assert all(layer.self_attn.attention_impl == impl for layer in model.layers)
  for ref, ker in zip(ref_logits, ker_logits):
    np.testing.assert_allclose(ker, ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(jnp.argmax(ker, -1), jnp.argmax(ref, -1))  # same greedy tokens
  for ref, ker in zip(ref_cache.k + ref_cache.v, ker_cache.k + ker_cache.v):
    np.testing.assert_allclose(ker, ref, atol=1e-5, rtol=1e-5)
