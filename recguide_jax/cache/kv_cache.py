"""Paged KV cache: fixed-size device page arrays (a registered dataclass pytree) and the host-side page allocator.

Device side: K and V arrays with every layer stacked, [num_layers, num_pages, page_size, kv_heads * head_dim]. The
KV heads are folded into the last (lane) dimension so a TPU kernel DMAs pages as they lie, without a relayout. The
scanned layer stack carries the whole cache and each layer scatters and gathers its own pages in place at its layer
index: no step slices a layer out, which would copy it. Page 0 is never handed out: padded batch slots and
uncommitted tokens write into it, so a step needs no branch on "is this slot real". A request's page table maps its
logical page i (token positions i*page_size ..) to a physical page. On the CPU a bf16/fp16 cache holds the floats'
bits as unsigned integers (`storage_dtype`). Host side: `PageAllocator` owns which pages are free; commit, crop and
free only change the host's tables and per-request lengths.

Automatic prefix caching (vLLM's, on by default in the engine): a full page of a prompt, once prefilled, is
registered under the hash of its token prefix chain (sha256 of the parent page's hash and the page's tokens, so equal
hashes mean equal prefixes), and a later request whose prompt starts with the same pages takes them by reference
(`match_prefix`) and prefills only the rest. A cached page that no request owns any more is kept, least recently
used first, until the allocator needs a page and evicts it. Only pages that are full of prompt tokens and below a
request's committed length are registered: every step writes at or past a request's committed length, so a cached
page is never written again (`crop` refuses to cut into one, which would need a copy-on-write).

Samples of one prompt (`n > 1`) share its prefill: `fork` gives a sibling the full pages of the prompt another
request already wrote, reference-counted, so a page returns to the free list only when its last owner lets go of
it. Only full pages are shared and every step writes at or past a request's committed length, so a shared page is
never written again; the partial last page is the sibling's own (the engine recomputes its few tokens).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

TRASH_PAGE = 0


def pages_per_seq(max_model_len: int, max_block: int, page_size: int) -> int:
  """Pages one sequence of `max_model_len` pledges: a verify may write up to one block past its last token."""
  return -(-(max_model_len + max_block) // page_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  k: jax.Array  # [num_layers, num_pages, page_size, kv_heads * head_dim], the model's dtype (on the CPU: its bits)
  v: jax.Array

  @property
  def num_layers(self) -> int:
    return self.k.shape[0]

  @property
  def num_pages(self) -> int:
    return self.k.shape[1]

  @property
  def page_size(self) -> int:
    return self.k.shape[2]

  @staticmethod
  def shape(num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_layers, num_pages, page_size, kv_heads * head_dim)

  @classmethod
  def create(cls, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
             dtype=jnp.float32, sharding: jax.sharding.Sharding | None = None) -> "KVCache":
    shape = cls.shape(num_layers, num_pages, page_size, kv_heads, head_dim)
    # zeros made on the target device(s) directly, never on the host and then copied
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return cls(k=make(), v=make())

  @classmethod
  def abstract(cls, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
               dtype=jnp.float32, sharding: jax.sharding.Sharding | None = None) -> "KVCache":
    """The cache's shapes only (`jax.ShapeDtypeStruct`s): for lowering and compiling without allocating it."""
    sds = jax.ShapeDtypeStruct(cls.shape(num_layers, num_pages, page_size, kv_heads, head_dim), dtype,
                               sharding=sharding)
    return cls(k=sds, v=sds)


def _slots(page_table: jax.Array, positions: jax.Array, write: jax.Array, page_size: int):
  logical = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
  page = jnp.take_along_axis(page_table, logical, axis=1)
  return jnp.where(write, page, TRASH_PAGE), positions % page_size


def write_block(k_pages: jax.Array, v_pages: jax.Array, k_new: jax.Array, v_new: jax.Array,
                page_table: jax.Array, positions: jax.Array, write: jax.Array,
                layer: jax.Array | int | None = None, as_rows: bool = False) -> tuple[jax.Array, jax.Array]:
  """Scatters per-token K/V into their pages: token (r, t) goes to slot `positions[r, t]` of request r.

  k_new/v_new: [b, T, kv_heads, D]; page_table: [b, P]; positions, write: [b, T]. Tokens with write=False land on
  the trash page, so the scatter has a static shape. Pages are one layer's [num_pages, page_size, H * D] when
  `layer` is None, else every layer's [L, num_pages, page_size, H * D] and the tokens go to layer `layer` (an int
  or an int32 scalar, e.g. a scan's layer index): one scatter into the stacked array, updated in place when it is
  donated or loop-carried. `as_rows` (for the TPU): a scatter of whole rows into the pages viewed as
  [rows, H * D], the same update.
  """
  shape = k_pages.shape
  num_pages, page_size, width = shape[-3:]
  page, offset = _slots(page_table, positions, write, page_size)
  if not as_rows:
    idx = (page, offset) if layer is None else (jnp.asarray(layer, jnp.int32), page, offset)
    return (k_pages.at[idx].set(to_storage(fold_heads(k_new), k_pages.dtype)),
            v_pages.at[idx].set(to_storage(fold_heads(v_new), v_pages.dtype)))
  # indexed by (layer, page, offset), libtpu gave the loop-carried cache another layout at one KV head per device
  # and copied all of it back for the attention kernel in every layer; XLA:CPU copies the reshaped one instead
  row = page * page_size + offset
  if layer is not None:
    row = row + jnp.asarray(layer, jnp.int32) * (num_pages * page_size)
  row = row.reshape(-1)

  def put(pages, new):
    rows = pages.reshape(-1, width).at[row].set(to_storage(fold_heads(new), pages.dtype).reshape(-1, width))
    return rows.reshape(shape)

  return put(k_pages, k_new), put(v_pages, v_new)


def fold_heads(x: jax.Array) -> jax.Array:
  """[..., H, D] -> [..., H * D], the cache's layout of a token's K or V (head h on lanes [h * D, (h + 1) * D))."""
  return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def gather_prefix(pages: jax.Array, page_table: jax.Array, layer: jax.Array | int | None = None,
                  dtype=None, *, kv_heads: int) -> jax.Array:
  """[num_pages, page_size, H * D] (or stacked [L, ...] read at `layer`) x [b, P] -> [b, P*page_size, H, D]: the
  request's logical KV in order, `kv_heads` = H. With `layer` this is one gather of the table's pages from the
  stacked array. Pages that hold raw bits (`storage_dtype`) come back as `dtype`, the float they hold."""
  g = pages[page_table] if layer is None else pages[jnp.asarray(layer, jnp.int32), page_table]
  b, p, s, hd = g.shape
  return from_storage(g.reshape(b, p * s, kv_heads, hd // kv_heads), dtype)


# XLA:CPU gathers and scatters 16- and 8-bit floats by converting the whole operand to f32 and back, so on the CPU
# the cache holds their bits as unsigned integers (bit-exact; measurements: docs/cpu_tuning.md).
_BITS = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16)}


def storage_dtype(dtype, platform: str | None) -> np.dtype:
  """The dtype the cache's arrays hold for a model of `dtype` on `platform` (None: not known, the float)."""
  dtype = np.dtype(dtype)
  if platform == "cpu" and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in _BITS:
    return _BITS[dtype.itemsize]
  return dtype


def holds_bits(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.unsignedinteger)


def to_storage(x: jax.Array, storage) -> jax.Array:
  """`x` (K or V in the model's dtype) as the cache's element type `storage`."""
  if not holds_bits(storage):
    return x.astype(storage)
  if np.dtype(x.dtype).itemsize != np.dtype(storage).itemsize:
    raise ValueError(f"a cache of {np.dtype(storage).name} bits takes K/V of that width, got {x.dtype}")
  return jax.lax.bitcast_convert_type(x, storage)


def from_storage(x: jax.Array, dtype) -> jax.Array:
  """Pages read from the cache as the float `dtype` they hold (unchanged unless they hold bits)."""
  if not holds_bits(x.dtype):
    return x
  if dtype is None or np.dtype(dtype).itemsize != x.dtype.itemsize:
    raise ValueError(f"pages of {x.dtype} bits are read as a float of that width, got {dtype}")
  return jax.lax.bitcast_convert_type(x, dtype)


class OutOfPages(RuntimeError):
  """No free KV page is left for an allocation."""


class PageAllocator:
  """Host-side owner of the physical pages and of each request's page list and committed length.

  Each request holds a row of the allocator's page table (its pages in logical order, TRASH_PAGE past them) with its
  page count and committed length beside it (`table_rows`). A batch's page table and lengths are then one gather of
  its requests' rows, and its reserve, commit and trim are array operations that loop only over the rows whose page
  lists change.

  Invariant (checked by `check`): every page except the trash page is either free or owned by at least one
  request, a page owned by k requests has reference count k (k > 1 only for the full prompt pages `fork` shares),
  and each request's committed length fits the pages it owns.
  """

  def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int, enable_prefix_caching: bool = False):
    if num_pages < 2:
      raise ValueError("num_pages must be >= 2 (page 0 is the reserved trash page)")
    if page_size <= 0 or max_pages_per_seq <= 0:
      raise ValueError("page_size and max_pages_per_seq must be positive")
    self.num_pages = num_pages
    self.page_size = page_size
    self.max_pages_per_seq = max_pages_per_seq
    # LIFO free list: recently freed pages are reused first (warm in cache).
    self._free: list[int] = list(range(num_pages - 1, 0, -1))
    self._row: dict[object, int] = {}  # request -> its row (row of the arrays below)
    self._free_rows: list[int] = []
    self._table = np.zeros((0, max_pages_per_seq), np.int32)  # [rows, max_pages_per_seq]
    self._num_pages_of = np.zeros((0,), np.int64)  # [rows] pages each row holds
    self._lengths = np.zeros((0,), np.int64)  # [rows] committed tokens
    self._refs: dict[int, int] = {}  # owners of each page held by more than one request (absent: one owner)
    self.enable_prefix_caching = enable_prefix_caching
    self._cached: dict[bytes, int] = {}  # prefix chain hash -> the page holding that prefix's last page of K/V
    self._page_hash: dict[int, bytes] = {}  # the inverse
    # cached pages no request owns, least recently released first: free for the taking, reused if matched first
    self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
    self._prompt_hashes: dict[object, list[bytes]] = {}  # each request's full prompt pages' chain hashes

  # -- queries --
  @property
  def num_free(self) -> int:
    """Pages a request can be given: the free list and the cached pages nobody owns (evicted on demand)."""
    return len(self._free) + len(self._evictable)

  @property
  def num_cached(self) -> int:
    """Pages registered in the prefix cache (owned or not)."""
    return len(self._page_hash)

  @property
  def num_used(self) -> int:
    return self.num_pages - 1 - self.num_free

  def pages_for(self, num_tokens: int) -> int:
    return -(-num_tokens // self.page_size)

  def can_hold(self, seq_id, num_tokens: int) -> bool:
    have = int(self._num_pages_of[self._row[seq_id]]) if seq_id in self._row else 0
    need = self.pages_for(num_tokens)
    return need <= self.max_pages_per_seq and need - have <= self.num_free

  def length(self, seq_id) -> int:
    return int(self._lengths[self._row[seq_id]])

  def pages(self, seq_id) -> list[int]:
    s = self._row[seq_id]
    return self._table[s, :self._num_pages_of[s]].tolist()

  def owners(self) -> Iterable[object]:
    return self._row.keys()

  def table_rows(self, seq_ids: Sequence[object]) -> np.ndarray:
    """The table rows of `seq_ids` (for the batched operations below)."""
    row = self._row
    return np.fromiter((row[s] for s in seq_ids), np.int64, len(seq_ids))

  def lengths(self, rows: np.ndarray) -> np.ndarray:
    """The committed lengths of `rows`."""
    return self._lengths[rows]

  @property
  def num_shared(self) -> int:
    """Pages owned by more than one request."""
    return len(self._refs)

  def shareable_tokens(self, num_tokens: int) -> int:
    """Of a prompt of `num_tokens` tokens, how many a sibling can take from shared pages: whole pages, and never
    the last token (its forward samples the sibling's own first token)."""
    return (max(num_tokens - 1, 0) // self.page_size) * self.page_size

  # -- mutations --
  def add(self, seq_id) -> None:
    if seq_id in self._row:
      raise KeyError(f"sequence {seq_id!r} already has pages")
    if not self._free_rows:  # grow the row arrays (doubling)
      old = len(self._lengths)
      new = max(8, 2 * old)
      self._table = np.concatenate([self._table, np.zeros((new - old, self.max_pages_per_seq), np.int32)])
      self._num_pages_of = np.concatenate([self._num_pages_of, np.zeros((new - old,), np.int64)])
      self._lengths = np.concatenate([self._lengths, np.zeros((new - old,), np.int64)])
      self._free_rows = list(range(new - 1, old - 1, -1))
    self._row[seq_id] = self._free_rows.pop()

  def _append(self, s: int, pages: Sequence[int]) -> None:
    k = int(self._num_pages_of[s])
    self._table[s, k:k + len(pages)] = pages
    self._num_pages_of[s] = k + len(pages)

  def _drop_rows(self, rows: np.ndarray, keep: np.ndarray) -> None:
    """Releases the pages of table rows `rows` past their first `keep[i]` (rows holding no more are left alone):
    each row's last first, row by row."""
    if len(rows) == 1:  # one request (it finished, or is cropped): without the batch arithmetic
      s, k = int(rows[0]), int(keep[0])
      end = int(self._num_pages_of[s])
      if end <= k:
        return
      dropped = self._table[s, k:end][::-1].tolist()
      self._table[s, k:end] = TRASH_PAGE
      self._num_pages_of[s] = k
    else:
      count = self._num_pages_of[rows] - keep
      cut = count > 0
      if not cut.any():
        return
      rows, keep, count = rows[cut], keep[cut], count[cut]
      within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
      at = (np.repeat(rows, count), np.repeat(keep + count - 1, count) - within)
      dropped = self._table[at].tolist()
      self._table[at] = TRASH_PAGE
      self._num_pages_of[rows] = keep
    if self._refs.keys().isdisjoint(dropped) and self._page_hash.keys().isdisjoint(dropped):
      self._free.extend(dropped)  # each page's only owner let go of it: straight to the free list
    else:
      for p in dropped:
        self._release(p)

  def fork(self, src, dst, num_tokens: int) -> int:
    """Gives `dst` (added, holding no pages) the pages of `src` that hold its first `num_tokens` committed tokens,
    whole pages only (rounded down), shared by reference; returns the tokens shared (dst's committed length)."""
    d = self._row[dst]
    if self._num_pages_of[d]:
      raise ValueError(f"fork into {dst!r}, which already holds pages")
    if num_tokens > self.length(src):
      raise ValueError(f"fork of {num_tokens} tokens > committed length {self.length(src)} of {src!r}")
    shared = self.pages(src)[:num_tokens // self.page_size]
    for p in shared:
      self._refs[p] = self._refs.get(p, 1) + 1
    self._append(d, shared)
    self._lengths[d] = len(shared) * self.page_size
    return int(self._lengths[d])

  def _release(self, page: int) -> None:
    """Drops one owner of `page`; the last one returns it to the free list (a cached page: to the evictable ones,
    as the most recently used)."""
    refs = self._refs.get(page, 1)
    if refs > 2:
      self._refs[page] = refs - 1
    elif refs == 2:
      del self._refs[page]
    elif page in self._page_hash:
      self._evictable[page] = None
    else:
      self._free.append(page)

  def _take(self, k: int) -> list[int]:
    """`k` pages for a request: from the free list (the most recently freed first), then the least recently used
    unowned cached pages (evicted). The caller checked that `k` are there."""
    n = min(k, len(self._free))
    out = self._free[len(self._free) - n:][::-1]
    del self._free[len(self._free) - n:]
    for _ in range(k - n):
      page, _ = self._evictable.popitem(last=False)
      del self._cached[self._page_hash.pop(page)]
      out.append(page)
    return out

  # -- prefix caching --
  def prompt_hashes(self, prompt_ids: Sequence[int]) -> list[bytes]:
    """The chain hash of each full page of a prompt: sha256(parent hash + the page's int32 tokens)."""
    tokens = np.asarray(prompt_ids, np.int32)
    out, parent = [], b""
    for i in range(len(tokens) // self.page_size):
      parent = hashlib.sha256(parent + tokens[i * self.page_size:(i + 1) * self.page_size].tobytes()).digest()
      out.append(parent)
    return out

  def match_prefix(self, seq_id, prompt_ids: Sequence[int], match: bool = True) -> int:
    """Gives `seq_id` (added, holding no pages) the cached pages of its prompt's longest cached page prefix, by
    reference (unless not `match`), and remembers its prompt's page hashes for `register_prefix`. Never the page of
    the last prompt token's position (its forward samples the first output token). Returns the tokens taken (its
    committed length); 0 with prefix caching off."""
    if not self.enable_prefix_caching:
      return 0
    s = self._row[seq_id]
    if self._num_pages_of[s]:
      raise ValueError(f"prefix match into {seq_id!r}, which already holds pages")
    hashes = self._prompt_hashes[seq_id] = self.prompt_hashes(prompt_ids)
    pages = []
    for h in hashes[:self.shareable_tokens(len(prompt_ids)) // self.page_size if match else 0]:
      page = self._cached.get(h)
      if page is None:
        break
      if page in self._evictable:
        del self._evictable[page]
      else:
        self._refs[page] = self._refs.get(page, 1) + 1
      pages.append(page)
    self._append(s, pages)
    self._lengths[s] = len(pages) * self.page_size
    return int(self._lengths[s])

  def register_prefix(self, seq_id) -> None:
    """Registers `seq_id`'s full prompt pages below its committed length in the prefix cache (a prefix some other
    page already holds keeps that page)."""
    hashes = self._prompt_hashes.get(seq_id)
    if not hashes:
      return
    pages = self.pages(seq_id)
    for i in range(min(len(hashes), self.length(seq_id) // self.page_size)):
      h, page = hashes[i], pages[i]
      if h not in self._cached and page not in self._page_hash:
        self._cached[h] = page
        self._page_hash[page] = h

  def reset_prefix_cache(self) -> None:
    """Forgets every cached prefix (vLLM's `reset_prefix_cache`): unowned cached pages return to the free list;
    owned ones become their owners' own."""
    self._free.extend(reversed(self._evictable))
    self._evictable.clear()
    self._cached.clear()
    self._page_hash.clear()

  def reserve(self, seq_id, num_tokens: int) -> None:
    """Makes sure the sequence has pages for positions [0, num_tokens); raises OutOfPages and changes nothing
    when that is impossible."""
    self.reserve_rows(self.table_rows((seq_id,)), np.array([num_tokens], np.int64))

  def reserve_rows(self, rows: np.ndarray, num_tokens: np.ndarray) -> None:
    """`reserve` for a batch's table rows at once (`rows[i]` up to `num_tokens[i]` tokens): all or nothing."""
    need = -(-np.asarray(num_tokens, np.int64) // self.page_size)
    if len(need) and need.max() > self.max_pages_per_seq:
      raise OutOfPages(f"{int(np.asarray(num_tokens).max())} tokens exceed the per-sequence limit of "
                       f"{self.max_pages_per_seq * self.page_size}")
    extra = np.maximum(need - self._num_pages_of[rows], 0)
    total = int(extra.sum())
    if not total:
      return
    if total > self.num_free:
      raise OutOfPages(f"need {total} more KV pages, {self.num_free} free")
    grow = rows[extra > 0]
    rep = extra[extra > 0]
    taken = np.asarray(self._take(total), np.int32)
    # the (row, column) of each taken page, row by row in the batch's order
    start = self._num_pages_of[grow]
    cols = np.arange(total) - np.repeat(np.cumsum(rep) - rep, rep) + np.repeat(start, rep)
    self._table[np.repeat(grow, rep), cols] = taken
    self._num_pages_of[grow] = start + rep

  def commit(self, seq_id, length: int) -> None:
    """Sets the committed length (after a verify/prefill wrote K/V); pages must already be reserved."""
    self.commit_rows(self.table_rows((seq_id,)), np.array([length], np.int64))

  def commit_rows(self, rows: np.ndarray, lengths: np.ndarray) -> None:
    """`commit` for a batch's table rows at once."""
    over = lengths > self._num_pages_of[rows] * self.page_size
    if over.any():
      i = int(over.argmax())
      who = next(seq_id for seq_id, row in self._row.items() if row == rows[i])
      raise ValueError(f"commit to {int(lengths[i])} beyond reserved capacity of {who!r}")
    self._lengths[rows] = lengths

  def crop(self, seq_id, length: int) -> None:
    """Truncates to `length` committed tokens and returns pages past it to the free list."""
    s = self._row[seq_id]
    if length > self._lengths[s]:
      raise ValueError(f"crop to {length} > committed length {int(self._lengths[s])}")
    keep = self.pages_for(length)
    if length % self.page_size and keep <= self._num_pages_of[s]:
      last = int(self._table[s, keep - 1])  # kept partly: the next step writes into it
      if last in self._page_hash or last in self._refs:
        raise ValueError(f"crop of {seq_id!r} to {length} would have it write into a shared page (copy-on-write "
                         "is not implemented: only whole committed prompt pages are shared)")
    self._lengths[s] = length
    self._drop_rows(np.array([s]), np.array([keep]))

  def trim(self, seq_id, keep: int = 0) -> None:
    """Returns reserved-but-uncommitted pages (after a verify that accepted less than it reserved), but those of the
    `keep` tokens past the committed length (a call already dispatched writes there)."""
    self.trim_rows(self.table_rows((seq_id,)), keep)

  def trim_rows(self, rows: np.ndarray, keep: int = 0) -> None:
    """`trim` for a batch's table rows at once. The committed length does not move, so no shared page can become
    writable (a trim never cuts below what the request already wrote)."""
    self._drop_rows(rows, -(-(self._lengths[rows] + keep) // self.page_size))

  def free(self, seq_id) -> None:
    s = self._row.pop(seq_id, None)
    self._prompt_hashes.pop(seq_id, None)
    if s is None:
      return
    self._drop_rows(np.array([s]), np.zeros(1, np.int64))
    self._lengths[s] = 0
    self._free_rows.append(s)

  def write_page_table(self, seq_ids: Sequence[object], out: np.ndarray) -> None:
    """Writes the page-table rows of `seq_ids` into the first rows of `out` (TRASH_PAGE past each one's pages)."""
    self.write_page_rows(self.table_rows(seq_ids), out)

  def write_page_rows(self, rows: np.ndarray, out: np.ndarray) -> None:
    """`write_page_table` by table rows: one gather."""
    width = out.shape[1]
    if width < self.max_pages_per_seq and len(rows) and self._num_pages_of[rows].max() > width:
      raise ValueError(f"a page table {width} pages wide cannot hold "
                       f"{int(self._num_pages_of[rows].max())} pages")
    out[:len(rows)] = self._table[rows, :width]

  def page_table_row(self, seq_id, width: int | None = None) -> np.ndarray:
    row = np.full((width or self.max_pages_per_seq,), TRASH_PAGE, np.int32)
    self.write_page_table((seq_id,), row[None])
    return row

  def check(self) -> None:
    """Raises AssertionError if any page is lost, double-owned or a length exceeds its capacity."""
    seen = set(self._free)
    assert len(seen) == len(self._free), "duplicate page in free list"
    assert not seen & set(self._evictable), "a page both free and cached"
    assert set(self._evictable) <= set(self._page_hash), "an evictable page that is not cached"
    assert {self._cached[h] for h in self._page_hash.values()} == set(self._page_hash), "cache tables disagree"
    seen |= set(self._evictable)
    assert TRASH_PAGE not in seen, "trash page on the free list"
    assert len(set(self._row.values())) == len(self._row), "a row held twice"
    assert not set(self._row.values()) & set(self._free_rows), "a row both free and held"
    owners: dict[int, int] = {}
    for seq_id, s in self._row.items():
      pages = self.pages(seq_id)
      assert not self._table[s, len(pages):].any(), f"a page past the page count of {seq_id!r}"
      assert len(set(pages)) == len(pages), f"a page twice in the table of {seq_id!r}"
      for p in pages:
        assert p != TRASH_PAGE and p not in seen, f"page {p} both free and owned ({seq_id!r})"
        owners[p] = owners.get(p, 0) + 1
      assert self.length(seq_id) <= len(pages) * self.page_size, f"length past capacity for {seq_id!r}"
    for p, k in owners.items():
      assert self._refs.get(p, 1) == k, f"page {p} has {k} owners but reference count {self._refs.get(p, 1)}"
    assert set(self._refs) <= set(owners), "reference count of a page nobody owns"
    assert seen | set(owners) == set(range(1, self.num_pages)), "pages lost"
