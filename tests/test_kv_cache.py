import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from recguide_jax.cache.kv_cache import (TRASH_PAGE, OutOfPages, PageAllocator, gather_prefix, storage_dtype,
                                         write_block)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "reserve", "commit", "crop", "trim", "free"]),
                          st.integers(0, 5), st.integers(0, 120)), max_size=60))
def test_page_accounting_property(ops):
  alloc = PageAllocator(num_pages=24, page_size=8, max_pages_per_seq=10)
  live = set()
  for op, seq, n in ops:
    if op == "add":
      if seq in live:
        with pytest.raises(KeyError):
          alloc.add(seq)
      else:
        alloc.add(seq)
        live.add(seq)
    elif seq not in live:
      continue
    elif op == "reserve":
      before = (alloc.num_free, alloc.pages(seq))
      try:
        alloc.reserve(seq, n)
        assert len(alloc.pages(seq)) >= alloc.pages_for(n)
      except OutOfPages:
        assert (alloc.num_free, alloc.pages(seq)) == before  # a failed reserve changes nothing
    elif op == "commit":
      cap = len(alloc.pages(seq)) * alloc.page_size
      if n <= cap:
        alloc.commit(seq, n)
        assert alloc.length(seq) == n
      else:
        with pytest.raises(ValueError):
          alloc.commit(seq, n)
    elif op == "crop":
      if n <= alloc.length(seq):
        alloc.crop(seq, n)
        assert len(alloc.pages(seq)) == alloc.pages_for(n)
    elif op == "trim":
      alloc.trim(seq)
    elif op == "free":
      alloc.free(seq)
      live.discard(seq)
    alloc.check()
  for seq in list(live):
    alloc.free(seq)
  alloc.check()
  assert alloc.num_free == 23 and alloc.num_used == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "commit", "trim"]),
                          st.lists(st.tuples(st.integers(0, 5), st.integers(0, 90)), min_size=1, max_size=6,
                                   unique_by=lambda t: t[0]),
                          st.integers(0, 20)), max_size=30))
def test_batched_operations_match_one_request_at_a_time(ops):
  """reserve_rows / commit_rows / trim_rows leave the same tables as the per-request calls in batch order (a
  batched reserve that cannot be met changes nothing)."""
  batched = PageAllocator(num_pages=40, page_size=8, max_pages_per_seq=10)
  single = PageAllocator(num_pages=40, page_size=8, max_pages_per_seq=10)
  for alloc in (batched, single):
    for seq in range(6):
      alloc.add(seq)
  for op, rows, keep in ops:
    seqs = [seq for seq, _ in rows]
    n = np.array([v for _, v in rows], np.int64)
    rows = batched.table_rows(seqs)
    if op == "reserve":
      before = [batched.pages(s) for s in range(6)], batched.num_free
      try:
        batched.reserve_rows(rows, n)
      except OutOfPages:
        assert ([batched.pages(s) for s in range(6)], batched.num_free) == before
        continue
      for seq, v in zip(seqs, n.tolist()):
        single.reserve(seq, v)
    elif op == "commit":
      n = np.minimum(n, [len(batched.pages(s)) * 8 for s in seqs])
      batched.commit_rows(rows, n)
      for seq, v in zip(seqs, n.tolist()):
        single.commit(seq, v)
    else:
      batched.trim_rows(rows, keep)
      for seq in seqs:
        single.trim(seq, keep)
    for alloc in (batched, single):
      alloc.check()
    assert [batched.pages(s) for s in range(6)] == [single.pages(s) for s in range(6)]
    assert [batched.length(s) for s in range(6)] == [single.length(s) for s in range(6)]
    table = np.zeros((len(seqs), 10), np.int32)
    batched.write_page_rows(rows, table)
    for row, seq in zip(table, seqs):
      assert row[:len(batched.pages(seq))].tolist() == batched.pages(seq) and not row[len(batched.pages(seq)):].any()


def test_trash_page_never_allocated():
  alloc = PageAllocator(num_pages=4, page_size=2, max_pages_per_seq=8)
  alloc.add("a")
  alloc.reserve("a", 6)
  assert TRASH_PAGE not in alloc.pages("a")
  with pytest.raises(OutOfPages):
    alloc.reserve("a", 7)
  row = alloc.page_table_row("a", 5)
  assert list(row[3:]) == [TRASH_PAGE, TRASH_PAGE]


@pytest.mark.parametrize("as_rows", [False, True])
def test_write_block_and_gather_roundtrip(as_rows):
  rng = np.random.default_rng(0)
  pages = jnp.zeros((6, 4, 2 * 3), jnp.float32)  # [N, S, H * D]: the heads folded into the last dim
  table = np.array([[2, 5, 1], [3, 4, 0]], np.int32)
  k_new = rng.normal(size=(2, 5, 2, 3)).astype(np.float32)
  positions = np.array([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]], np.int32)
  write = np.array([[True] * 5, [True, True, True, False, False]])
  k_pages, _ = write_block(pages, pages, k_new, k_new, table, positions, write, as_rows=as_rows)
  # token 3 of request 0 sits in logical page 0 (physical 2) at offset 3, head h on columns [3h, 3h + 3)
  np.testing.assert_array_equal(np.asarray(k_pages[2, 3]), k_new[0, 0].reshape(-1))
  logical = np.asarray(gather_prefix(k_pages, table, kv_heads=2))
  np.testing.assert_array_equal(logical[0, 3:8], k_new[0])
  np.testing.assert_array_equal(logical[1, 0:3], k_new[1, :3])
  np.testing.assert_array_equal(logical[1, 3:5], 0)  # unwritten tokens went to the trash page


@pytest.mark.parametrize("as_rows", [False, True])
def test_stacked_write_and_gather_touch_only_their_layer(as_rows):
  """The scanned model's layout: every layer's pages in one [L, N, S, H * D] array, written and read at a layer
  (as a scatter at (layer, page, offset), or of whole rows as the TPU step does)."""
  rng = np.random.default_rng(1)
  pages = jnp.asarray(rng.normal(size=(3, 6, 4, 2 * 3)).astype(np.float32))
  table = np.array([[2, 5, 1], [3, 4, 0]], np.int32)
  k_new = rng.normal(size=(2, 5, 2, 3)).astype(np.float32)
  positions = np.array([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]], np.int32)
  write = np.array([[True] * 5, [True, True, True, False, False]])
  k_pages, _ = write_block(pages, pages, k_new, k_new, table, positions, write, layer=jnp.int32(1), as_rows=as_rows)
  # layer 1 equals a single-layer write of its own pages; the other layers are untouched
  want_1, _ = write_block(pages[1], pages[1], k_new, k_new, table, positions, write)
  np.testing.assert_array_equal(np.asarray(k_pages[1]), np.asarray(want_1))
  np.testing.assert_array_equal(np.asarray(k_pages[0]), np.asarray(pages[0]))
  np.testing.assert_array_equal(np.asarray(k_pages[2]), np.asarray(pages[2]))
  for layer in range(3):
    np.testing.assert_array_equal(np.asarray(gather_prefix(k_pages, table, layer, kv_heads=2)),
                                  np.asarray(gather_prefix(k_pages[layer], table, kv_heads=2)))
  logical = np.asarray(gather_prefix(k_pages, table, 1, kv_heads=2))
  np.testing.assert_array_equal(logical[0, 3:8], k_new[0])


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 60), st.lists(st.tuples(st.sampled_from(["grow", "crop", "free"]), st.integers(0, 2),
                                              st.integers(0, 80)), max_size=30))
def test_forked_pages_are_reference_counted(prompt_len, ops):
  """Samples of one prompt share its full pages: each frees only its own, a shared page returns to the free list
  with its last owner, and no page is lost or double-owned whatever the order."""
  alloc = PageAllocator(num_pages=40, page_size=8, max_pages_per_seq=12)
  alloc.add(0)
  alloc.reserve(0, prompt_len)
  alloc.commit(0, prompt_len)
  shareable = alloc.shareable_tokens(prompt_len)
  assert shareable % 8 == 0 and shareable < prompt_len
  for dst in (1, 2):
    alloc.add(dst)
    assert alloc.fork(0, dst, shareable) == shareable
    assert alloc.pages(dst) == alloc.pages(0)[:shareable // 8]
  assert alloc.num_shared == shareable // 8
  alloc.check()
  live = {0, 1, 2}
  for op, seq, n in ops:
    if seq not in live:
      continue
    if op == "grow":
      try:
        alloc.reserve(seq, alloc.length(seq) + n)
        alloc.commit(seq, alloc.length(seq) + n)
      except OutOfPages:
        pass
    elif op == "crop":
      target = min(n, alloc.length(seq))
      into = alloc.pages(seq)[target // 8] if target % 8 else None  # the page its next write would go to
      if into is not None and any(into in alloc.pages(s) for s in live if s != seq):
        with pytest.raises(ValueError, match="shared page"):  # its next write would need a copy-on-write
          alloc.crop(seq, target)
      else:
        alloc.crop(seq, target)
    else:
      alloc.free(seq)
      live.discard(seq)
    alloc.check()
  for seq in live:
    alloc.free(seq)
  alloc.check()
  assert alloc.num_used == 0 and alloc.num_shared == 0


def admit(alloc, seq, prompt):
  """What the engine does with a prompt: match its cached prefix, prefill the rest, register its full pages."""
  alloc.add(seq)
  hit = alloc.match_prefix(seq, prompt)
  alloc.reserve(seq, len(prompt))
  alloc.commit(seq, len(prompt))
  alloc.register_prefix(seq)
  return hit


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "free", "reset"]), st.integers(0, 5),
                          st.lists(st.integers(0, 2), min_size=1, max_size=30)), max_size=40))
def test_prefix_cache_accounting_property(ops):
  """Prompts over a 3-token alphabet share prefixes often: whatever the order of admissions, growth, frees and
  resets, a match takes exactly the longest cached run of whole pages of the prompt (never its last token), no page
  is lost, double-owned or cached twice, and once everything is freed and the cache reset every page is free."""
  alloc = PageAllocator(num_pages=24, page_size=4, max_pages_per_seq=12, enable_prefix_caching=True)
  prompts, live = {}, set()
  for op, seq, prompt in ops:
    if op == "admit" and seq not in live:
      if alloc.num_free < alloc.pages_for(len(prompt)):
        continue
      cached = set(alloc._cached)
      want = 0
      for h in alloc.prompt_hashes(prompt)[:alloc.shareable_tokens(len(prompt)) // 4]:
        if h not in cached:
          break
        want += 4
      assert admit(alloc, seq, prompt) == want
      prompts[seq] = prompt
      live.add(seq)
    elif op == "grow" and seq in live:
      try:
        alloc.reserve(seq, alloc.length(seq) + len(prompt))
        alloc.commit(seq, alloc.length(seq) + len(prompt))
      except OutOfPages:
        pass
    elif op == "free" and seq in live:
      alloc.free(seq)
      live.discard(seq)
    elif op == "reset":
      alloc.reset_prefix_cache()
    alloc.check()
  for seq in live:
    alloc.free(seq)
  alloc.check()
  assert alloc.num_used == 0
  alloc.reset_prefix_cache()
  alloc.check()
  assert alloc.num_free == alloc.num_pages - 1 and alloc.num_cached == 0


def test_prefix_cache_keys_are_prefix_chains_and_evicts_least_recently_used():
  alloc = PageAllocator(num_pages=9, page_size=2, max_pages_per_seq=8, enable_prefix_caching=True)
  assert admit(alloc, "a", [1, 2, 3, 4, 5]) == 0
  assert admit(alloc, "b", [1, 2, 3, 4, 9]) == 4  # both full pages (the last token is never taken)
  assert alloc.pages("b")[:2] == alloc.pages("a")[:2] and alloc.num_shared == 2
  assert admit(alloc, "c", [7, 7, 3, 4, 5]) == 0  # page [3, 4] after another first page is another prefix
  assert admit(alloc, "d", [1, 2, 3, 4]) == 2  # [3, 4] holds the last token: only [1, 2] is taken
  for seq in "abcd":
    alloc.free(seq)
  alloc.check()
  assert alloc.num_used == 0 and alloc.num_cached == 4 and alloc.num_free == 8
  # release order, least recent first: a's [3, 4] (b let go of it last), c's two pages, then [1, 2] (d)
  alloc.add("e")
  alloc.reserve("e", 4 * 2)  # the four free pages
  assert alloc.num_cached == 4
  alloc.reserve("e", 5 * 2)  # evicts a's [3, 4]: the prefix [1, 2, 3, 4] is cached no more
  assert alloc.num_cached == 3
  assert admit(alloc, "f", [1, 2, 3, 4, 5]) == 2  # [1, 2] is; f's two fresh pages evict c's, the next least recent
  assert alloc.num_cached == 2 and alloc.num_free == 0  # [1, 2] and f's own [3, 4]
  alloc.check()
  alloc.free("f")
  alloc.free("e")
  alloc.reset_prefix_cache()
  alloc.check()
  assert alloc.num_free == 8 and alloc.num_cached == 0


def test_shared_cached_pages_are_never_cut_into():
  alloc = PageAllocator(num_pages=9, page_size=2, max_pages_per_seq=8, enable_prefix_caching=True)
  admit(alloc, "a", [1, 2, 3, 4, 5])
  with pytest.raises(ValueError, match="copy-on-write"):
    alloc.crop("a", 3)  # its next step would write into the cached page [3, 4]
  alloc.crop("a", 4)  # whole pages: the next write starts a fresh page
  alloc.check()


def test_fork_refuses_what_it_cannot_share():
  alloc = PageAllocator(num_pages=8, page_size=4, max_pages_per_seq=4)
  alloc.add("a")
  alloc.reserve("a", 10)
  alloc.commit("a", 10)
  alloc.add("b")
  with pytest.raises(ValueError, match="committed length"):
    alloc.fork("a", "b", 11)
  assert alloc.fork("a", "b", 9) == 8  # whole pages only
  with pytest.raises(ValueError, match="already holds pages"):
    alloc.fork("a", "b", 4)
  alloc.free("a")  # the source goes first: the shared pages stay with b
  alloc.check()
  assert alloc.num_used == 2 and alloc.num_shared == 0


def test_narrow_float_caches_hold_bits_on_the_cpu_only():
  assert storage_dtype(jnp.bfloat16, "cpu") == np.uint16 and storage_dtype(jnp.float16, "cpu") == np.uint16
  assert storage_dtype(jnp.float8_e4m3fn, "cpu") == np.uint8
  assert storage_dtype(jnp.float32, "cpu") == np.float32  # XLA:CPU gathers f32 natively
  for platform in ("gpu", "tpu", None):  # accelerators (and an unknown platform) keep the float
    assert storage_dtype(jnp.bfloat16, platform) == jnp.bfloat16


def test_a_cache_of_bits_writes_and_reads_what_a_float_cache_does():
  """Write then gather through a bf16 cache and through its uint16 twin: the same bits in the pages, the same
  bf16 values read back (bit-exact, no rounding on the way), and the pages read as floats only with a dtype."""
  rng = np.random.default_rng(0)
  shape = (2, 6, 4, 2 * 8)  # [L, num_pages, page_size, H * D]
  floats = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  bits = jax.lax.bitcast_convert_type(floats, jnp.uint16)
  k_new = jnp.asarray(rng.standard_normal((2, 3, 2, 8)) * 1e3, jnp.bfloat16)  # values far from the old ones
  page_table = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
  positions = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
  write = jnp.asarray([[True, True, False], [True, True, True]])
  fk, _ = write_block(floats, floats, k_new, k_new, page_table, positions, write, layer=1)
  bk, _ = write_block(bits, bits, k_new, k_new, page_table, positions, write, layer=1)
  assert bk.dtype == jnp.uint16
  np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(fk, jnp.uint16)), np.asarray(bk))
  read_f = gather_prefix(fk, page_table, 1, kv_heads=2)
  read_b = gather_prefix(bk, page_table, 1, jnp.bfloat16, kv_heads=2)
  assert read_b.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(read_f, np.float32), np.asarray(read_b, np.float32))
  with pytest.raises(ValueError, match="read as a float"):
    gather_prefix(bk, page_table, 1, kv_heads=2)
  with pytest.raises(ValueError, match="bits takes K/V"):
    write_block(bits, bits, k_new.astype(jnp.float32), k_new, page_table, positions, write, layer=1)


def test_one_row_drops_release_pages_as_the_batched_path_does():
  """`free` (one row: `_drop_rows`' scalar path) against the batched path (the same row beside a row holding no
  pages): the same free list, in the same order, and the same shared and cached pages, with forks and cached
  prefixes among them."""
  rng = np.random.default_rng(0)
  for _ in range(20):
    allocs = [PageAllocator(num_pages=64, page_size=4, max_pages_per_seq=12, enable_prefix_caching=True)
              for _ in range(2)]
    prompt = rng.integers(0, 50, 16).tolist()
    for alloc in allocs:
      for seq in range(7):  # 6 never holds a page
        alloc.add(seq)
      alloc.match_prefix(0, prompt, True)
      alloc.reserve(0, 16)
      alloc.commit(0, 16)
      alloc.register_prefix(0)
    sizes = rng.integers(0, 40, 6)
    for seq in range(1, 6):
      if rng.random() < 0.5:
        shared = int(rng.integers(0, 17)) // 4 * 4
        for alloc in allocs:
          alloc.fork(0, seq, shared)
      for alloc in allocs:
        alloc.reserve(seq, max(alloc.length(seq), int(sizes[seq])))
    for seq in rng.permutation(6).tolist():
      allocs[0].free(seq)
      allocs[1]._drop_rows(allocs[1].table_rows([seq, 6]), np.zeros(2, np.int64))
      allocs[1].free(seq)
      for alloc in allocs:
        alloc.check()
      assert allocs[0]._free == allocs[1]._free
      assert list(allocs[0]._evictable) == list(allocs[1]._evictable) and allocs[0]._refs == allocs[1]._refs
