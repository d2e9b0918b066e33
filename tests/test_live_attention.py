"""The live-context XLA attention equals the full-gather reference for every mask kind, ragged prefixes (0, inside
a page, on a page boundary, the whole table), whole and tail chunk sizes and both page layouts, and reads only the
chunks the longest live prefix needs: whole chunks, then tail chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import block_attention_ref, causal_mask, full_mask

from recguide_jax.attention import paged as live_attention


def _case(seed, b=3, nq=4, hq=4, hkv=2, d=8, num_pages=32, page_size=4, width=9, layers=None):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, nq, hq, d)).astype(np.float32)
  kb = rng.normal(size=(b, nq, hkv, d)).astype(np.float32)
  vb = rng.normal(size=(b, nq, hkv, d)).astype(np.float32)
  shape = (num_pages, page_size, hkv * d) if layers is None else (layers, num_pages, page_size, hkv * d)
  kp = rng.normal(size=shape).astype(np.float32)
  vp = rng.normal(size=shape).astype(np.float32)
  table = rng.permutation(np.arange(1, num_pages))[:b * width].reshape(b, width).astype(np.int32)
  return q, kb, vb, kp, vp, table


MASKS = {"causal": causal_mask(4), "full": full_mask(4),
         "tree": np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)}


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("chunk_tokens", [4, 8, 12, 256])  # one page, two pages, three (9 not divisible), all
@pytest.mark.parametrize("tail_chunk_tokens", [4, 8, 32])  # one page, two (a divisor of 3 pages: one), all
def test_matches_the_full_gather_reference(mask, chunk_tokens, tail_chunk_tokens):
  q, kb, vb, kp, vp, table = _case(0)
  for prefix_len in ([0, 13, 36], [9, 25, 17], [36, 36, 36]):  # nothing, mid-page, the whole table; tails; all
    kw = dict(k_pages=kp, v_pages=vp, page_table=table, prefix_len=np.array(prefix_len, np.int32), scale=0.3)
    want = block_attention_ref(q, kb, vb, MASKS[mask], **kw)
    got = live_attention.block_attention(q, kb, vb, MASKS[mask], chunk_tokens=chunk_tokens,
                                         tail_chunk_tokens=tail_chunk_tokens, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_tail_chunks_divide_a_whole_chunk():
  assert live_attention.tail_chunk_pages(16, 16) == 2  # the defaults: 256-token chunks, 32-token tails
  assert live_attention.tail_chunk_pages(3, 4, tail_tokens=8) == 1  # 2 pages do not divide 3
  assert live_attention.tail_chunk_pages(6, 4, tail_tokens=12) == 3
  assert live_attention.tail_chunk_pages(4, 16, tail_tokens=8) == 1  # less than a page: one page


def test_stacked_layers_under_jit_with_a_traced_layer():
  q, kb, vb, kp, vp, table = _case(1, layers=3)
  prefix_len = np.array([8, 5, 1], np.int32)  # a page boundary, mid-page, one token
  fn = jax.jit(lambda layer: live_attention.block_attention(
      q, kb, vb, MASKS["causal"], k_pages=kp, v_pages=vp, page_table=table, prefix_len=prefix_len, scale=0.3,
      layer=layer, chunk_tokens=8))
  for layer in range(3):
    want = block_attention_ref(q, kb, vb, MASKS["causal"], k_pages=kp, v_pages=vp, page_table=table,
                                         prefix_len=prefix_len, scale=0.3, layer=layer)
    np.testing.assert_allclose(fn(jnp.int32(layer)), want, rtol=1e-5, atol=1e-5)


def test_no_prefix_is_block_attention_only():
  q, kb, vb, *_ = _case(2)
  want = block_attention_ref(q, kb, vb, MASKS["full"], scale=0.5)
  np.testing.assert_allclose(live_attention.block_attention(q, kb, vb, MASKS["full"], scale=0.5), want,
                             rtol=1e-5, atol=1e-5)


def _read_only_first_pages(case_seed: int, prefix_len, first: int, **chunks):
  """Poisons (NaN) every page of each row's table from column `first` on: the result must stay finite and equal
  the clean one, i.e. the loops read columns < `first` only. Returns the clean result, the case and the prefix
  lengths."""
  q, kb, vb, kp, vp, table = case = _case(case_seed)
  kw = dict(page_table=table, prefix_len=np.array(prefix_len, np.int32), scale=0.3, **chunks)
  clean = live_attention.block_attention(q, kb, vb, MASKS["causal"], k_pages=kp, v_pages=vp, **kw)
  poisoned_k, poisoned_v = kp.copy(), vp.copy()
  for row in table:
    poisoned_k[row[first:]] = np.nan
    poisoned_v[row[first:]] = np.nan
  got = live_attention.block_attention(q, kb, vb, MASKS["causal"], k_pages=poisoned_k, v_pages=poisoned_v, **kw)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_array_equal(got, clean)
  return clean, case, kw["prefix_len"]


def test_pages_past_the_longest_prefix_are_never_read():
  """Poisoning every page past the live chunks (NaN) leaves the result finite and unchanged: the loop stopped."""
  _read_only_first_pages(3, [3, 7, 2], first=2, chunk_tokens=8)  # two pages at most: chunk 0 (8 tokens) only


def test_tail_chunks_read_less_than_one_tail_past_the_longest_prefix():
  """Whole chunks of 16 tokens (4 pages), then tails of 4 (1 page): a longest prefix of 21 tokens reads one whole
  chunk and two tail pages, pages 0-5; poisoning every later page changes nothing (a second whole chunk would read
  pages 6 and 7)."""
  got, (q, kb, vb, kp, vp, table), prefix_len = _read_only_first_pages(4, [21, 4, 17], first=6, chunk_tokens=16,
                                                                       tail_chunk_tokens=4)
  want = block_attention_ref(q, kb, vb, MASKS["causal"], k_pages=kp, v_pages=vp, page_table=table,
                                       prefix_len=prefix_len, scale=0.3)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
