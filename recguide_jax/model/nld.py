"""The NLD backbone in Flax NNX: Ministral3 decoder (pre-RMSNorm, GQA, YaRN RoPE, Llama-4 query scale, SwiGLU)
with an untied `diffusion_head` and an optional draft LoRA (on `o_proj` as NLD's, or on any of the attention and
MLP projections `NLDConfig.lora_target_modules` names) that is switched on per token. A plain Llama
is the same module under its config: default RoPE, no query scale, and the embedding as the output head
(`tie_word_embeddings`: no `diffusion_head` parameter at all).

One forward serves every decoding mode. Draft, verify, prefill, AR decode and RecGuide's fused tree forward differ
only in their inputs: the query tokens and positions per request, the intra-block mask, the per-token LoRA switch
and whether the block's K/V are written into the paged cache.

The decoder layers are ONE module with every weight stacked on a leading layer axis ([L, ...], as MaxText's
`scan_layers`), run by `jax.lax.scan`: a layer is traced and compiled once, so start-up time does not grow with
depth. The KV cache is stacked the same way and rides in the scan carry whole; each layer writes and reads its own
pages in place at its layer index (see kv_cache.py), so no step copies the cache.

`with_layer_loop(model, LayerLoop.UNROLLED)` holds the same layers as a list of modules with their own weight
buffers instead, run by an unrolled loop (see `LayerLoop` for when that is faster). Checkpoints, sharding and
training always see the stacked form.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import math
import re

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint
from flax import nnx

from recguide_jax.attention import reference as attn_lib
from recguide_jax.attention import dispatch as attention_dispatch
from recguide_jax.runtime import compilation, host_cpu
from recguide_jax.parallel import sharding
from recguide_jax.model import draft_head
from recguide_jax.model.config import DraftHead, NLDConfig
from recguide_jax.cache.kv_cache import KVCache, write_block
from recguide_jax.model import rope
from recguide_jax.model.params import flatten_params, unflatten_params


class _WeightArrangement(enum.Enum):
  """An option of how the runner holds the weights, named by its value in flags and keywords (the option's name
  is the class name in snake case: LayerLoop -> layer_loop)."""

  @classmethod
  def parse(cls, value):
    if isinstance(value, cls):
      return value
    try:
      return cls(str(value).lower())
    except ValueError:
      option = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()
      raise ValueError(f"{option} must be one of {[m.value for m in cls]}, got {value!r}") from None


class LayerLoop(_WeightArrangement):
  """How a forward runs the decoder layers.

  SCAN: one module whose weights are stacked [L, ...], run by `lax.scan`: a layer is compiled once whatever the
  depth.
  UNROLLED: one module per layer with its own weight buffers, run by a Python loop, each layer compiled apart:
  XLA:CPU copies every weight slice a scan takes on every step, a second trip to memory for weights larger than
  the last-level cache (measurements: docs/cpu_tuning.md), and so does XLA:GPU (a device-to-device copy of each
  layer's matrices before its GEMMs, more under rematerialization: docs/aot/aot_compile.md); libtpu reads them in
  place.
  AUTO: UNROLLED on GPUs (one or a mesh), and for concrete weights on a CPU device without a mesh whose bytes
  exceed the host's last-level cache, unless the step variants planned would then pass Linux's limit on the
  process's memory mappings (XLA:CPU maps each unrolled layer's kernels in every variant); SCAN otherwise (TPUs,
  CPU meshes, models that fit the cache, abstract CPU weights).
  """
  AUTO = "auto"
  SCAN = "scan"
  UNROLLED = "unrolled"


class KernelLayout(_WeightArrangement):
  """How the dense layers hold their kernels.

  IN_OUT: [in, out] (nnx.Linear's), what checkpoints, sharding rules, training and accelerators see.
  OUT_IN: [out, in] (HF's), and a matmul of at most `SWAPPED_MATMUL_MAX_ROWS` rows computes kernel @ x^T: XLA:CPU's
  GEMMs fill register panels from their left operand, which a decode's few activation rows leave mostly idle
  (measurements: docs/cpu_tuning.md). Its dots ask for an f32 result rounded to the layer's dtype (`matmul_out_in`).
  A tied fp32 output head also keeps an [in, out] copy (`NLDModel.tied_head_in_out`) for one-row products: there
  XLA:CPU's row-times-matrix product reads a vocabulary-wide head faster than the swapped one.
  AUTO: OUT_IN for concrete weights on a CPU device without a mesh, IN_OUT otherwise.
  """
  AUTO = "auto"
  IN_OUT = "in_out"
  OUT_IN = "out_in"


class ProjectionFusion(_WeightArrangement):
  """Whether the projections that read the same input are one matmul.

  SEPARATE: q_proj, k_proj, v_proj and gate_proj, up_proj, as checkpoints, sharding rules and training hold them.
  FUSED: `self_attn.qkv_proj` and `mlp.gate_up_proj`, their kernels concatenated along the output axis (vLLM's
  QKVParallelLinear and MergedColumnParallelLinear): one read of the input and one matmul instead of three and two.
  A draft LoRA fuses with them: its A matrices side by side, its B matrices block-diagonal (zeros elsewhere), so
  each part's delta is its own. Not under a mesh: the concatenated output axis would split over tp shards unevenly.
  AUTO: FUSED for concrete weights on a CPU device without a mesh (measurements: docs/cpu_tuning.md), SEPARATE
  otherwise (not measured on accelerators).
  """
  AUTO = "auto"
  SEPARATE = "separate"
  FUSED = "fused"


# (module, fused name, part names): the projections FUSED joins
FUSED_PROJECTIONS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                     ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


# Rows up to which an OUT_IN matmul puts the weight on the left; past it x @ kernel^T is faster (docs/cpu_tuning.md).
SWAPPED_MATMUL_MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class RaggedLayout:
  """Where the packed query tokens of a ragged step ([1, T]: every request's tokens back to back, each row its own
  count) sit in the per-row layout [R, Qrow] that the paged cache and the attention read: the dense layers run on
  the T packed tokens only, while the cache write and the attention take the row layout with its block masks, page
  tables and prefix lengths per row (the XLA path; see attention/paged.py)."""
  slot: jax.Array  # [T] int32: the packed token's index into the flattened [R * Qrow] row layout
  token: jax.Array  # [R, Qrow] int32: the packed token in each row slot (empty slots: any, masked and unwritten)


@dataclasses.dataclass(frozen=True)
class ForwardInputs:
  """Per-call inputs of `NLDModel.__call__` (all arrays are batched over requests)."""
  tokens: jax.Array  # [b, Q] int32
  positions: jax.Array  # [b, Q] int32 absolute positions (RoPE and the Llama-4 scale)
  block_mask: jax.Array  # [b, Q, Q] or [Q, Q] bool: which block tokens a query may see
  prefix_len: jax.Array | None = None  # [b] committed prefix length (None: no prefix)
  page_table: jax.Array | None = None  # [b, P] int32
  kv_write: jax.Array | None = None  # [b, Q] bool: write this token's K/V into slot `positions` (None: no commit)
  lora_mask: jax.Array | None = None  # [b, Q] bool: draft LoRA on for this token
  scale_positions: jax.Array | None = None  # positions for the Llama-4 scale if they differ (training)
  # Training only: the tokens are [x_t | x_0] under the sbd_block_diff mask with this block size (block_mask is
  # then ignored and the structured attention skips the half of the scores that is always masked).
  train_block_size: int | None = None
  train_draft_head: DraftHead = DraftHead.SAME_POSITION  # how its noisy blocks see themselves (model/draft_head.py)
  # A ragged step: tokens/positions/lora_mask are the packed [1, T]; block_mask [R, Qrow, Qrow], kv_write [R, Qrow],
  # prefix_len [R] and page_table [R, P] are per row of `ragged`'s row layout
  ragged: RaggedLayout | None = None


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, *, param_dtype):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return self.weight[...] * xf.astype(dtype)  # HF: cast back before the weight


class Dense(nnx.Linear):
  """A bias-free nnx.Linear whose kernel may be held [out, in] (`KernelLayout.OUT_IN`, set by
  `with_kernel_layout`; the instance attribute `kernel_layout` is static, part of the graph), with an optional
  draft LoRA (`lora_a` [in, r], `lora_b` [r, out]: PEFT's lora_A / lora_B transposed) added only where the
  per-token `lora_mask` is on, so the same weights serve the verifier (off) and the drafter (on)."""
  kernel_layout = KernelLayout.IN_OUT

  def __call__(self, x, lora_mask: jax.Array | None = None, lora_scale: float = 0.0):
    if self.kernel_layout is KernelLayout.IN_OUT:
      y = super().__call__(x)
    else:
      xp, w = self.promote_dtype((x, self.kernel[...]), dtype=self.dtype)
      y = matmul_out_in(xp, w, self.precision)
    if lora_mask is not None and hasattr(self, "lora_a"):
      delta = (x @ self.lora_a[...].astype(x.dtype)) @ self.lora_b[...].astype(x.dtype)
      y = y + (lora_scale * delta * lora_mask[..., None].astype(delta.dtype)).astype(y.dtype)
    return y


def row_major(x: jax.Array) -> jax.Array:
  """`x` laid out row-major (`with_layout_constraint`). For the separate q, k and v projections' outputs: left free,
  libtpu lays q and k out heads-first for the attention after RoPE and gets there by copying the weights into that
  layout (each layer's slice in every step, or all of them once per multi-step decode call), where re-laying the
  activation costs kilobytes. Only there: pinned on the vocabulary-sharded head output too, a tp=4 CPU program's
  logprobs came out 3e-3 off one device's (docs/aot/tpu_weight_layout.md)."""
  return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


def matmul_out_in(x: jax.Array, w: jax.Array, precision=None) -> jax.Array:
  """x [..., in] @ w[out, in]^T -> [..., out] in x's dtype, the weight on the left for few rows (see KernelLayout):
  an OUT_IN Dense, and the tied output head, whose weight is the [V, H] embedding."""
  lead, rows = x.shape[:-1], math.prod(x.shape[:-1])
  x2 = x.reshape(rows, x.shape[-1])
  contract = (((1,), (1,)), ((), ()))
  # an f32 result rounded to the layer's dtype (what a bf16 matmul computes anyway): asked for a bf16 product,
  # XLA:CPU converts both operands to f32 in memory on every step (docs/cpu_tuning.md)
  acc = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else None
  if rows <= SWAPPED_MATMUL_MAX_ROWS:
    # a narrow float's one row is computed as two: XLA:CPU's matrix-vector product converts its weight to f32
    narrow = rows == 1 and acc is not None and jnp.dtype(x.dtype).itemsize < 4
    rhs = jnp.concatenate([x2, x2]) if narrow else x2
    # the barrier keeps XLA from folding the transpose into the dot's output layout, which would swap the
    # operands back
    y = jax.lax.optimization_barrier(jax.lax.dot_general(w, rhs, contract, precision=precision,
                                                         preferred_element_type=acc)).T[:rows]
  else:
    y = jax.lax.dot_general(x2, w, contract, precision=precision, preferred_element_type=acc)
  return y.astype(x.dtype).reshape(*lead, w.shape[0])


def _dense(rngs, din, dout, dtype, param_dtype, std=0.02, lora_rank: int = 0):
  layer = Dense(din, dout, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                kernel_init=nnx.initializers.normal(std), rngs=rngs)
  if lora_rank:
    # B starts at zero so a fresh adapter is the identity.
    layer.lora_a = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (din, lora_rank), param_dtype))
    layer.lora_b = nnx.Param(jnp.zeros((lora_rank, dout), param_dtype))
  return layer


def _lora_rank(cfg: NLDConfig, module: str) -> int:
  return cfg.lora_rank if module in cfg.lora_target_modules else 0


class Attention(nnx.Module):

  def __init__(self, cfg: NLDConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    h, nq, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    self.cfg = cfg
    self.q_proj = _dense(rngs, h, nq * d, dtype, param_dtype, lora_rank=_lora_rank(cfg, "q_proj"))
    self.k_proj = _dense(rngs, h, nkv * d, dtype, param_dtype, lora_rank=_lora_rank(cfg, "k_proj"))
    self.v_proj = _dense(rngs, h, nkv * d, dtype, param_dtype, lora_rank=_lora_rank(cfg, "v_proj"))
    self.o_proj = _dense(rngs, nq * d, h, dtype, param_dtype, lora_rank=_lora_rank(cfg, "o_proj"))

  def __call__(self, x, inp: ForwardInputs, cache: KVCache | None, layer: jax.Array | int):
    """x: [b, Q, H]; cache: every layer's pages (or None); layer: this layer's index into them."""
    cfg = self.cfg
    b, nq_tok, _ = x.shape
    lora = (inp.lora_mask if cfg.lora_rank else None), cfg.lora_scale
    nq, nkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    if hasattr(self, "qkv_proj"):  # ProjectionFusion.FUSED
      qkv = self.qkv_proj(x, *lora)
      q, k, v = qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]
    else:  # the accelerators' and meshes' arrangement: projected in place, not from re-laid weights
      q, k, v = (row_major(proj(x, *lora)) for proj in (self.q_proj, self.k_proj, self.v_proj))
    q = q.reshape(b, nq_tok, cfg.num_attention_heads, cfg.head_dim)
    k = k.reshape(b, nq_tok, cfg.num_key_value_heads, cfg.head_dim)
    v = v.reshape(b, nq_tok, cfg.num_key_value_heads, cfg.head_dim)
    # under a tp mesh each device keeps its own heads from here to o_proj (no-ops on one device)
    q = sharding.constrain(q, "batch", "length", "act_heads", "head_dim")
    k = sharding.constrain(k, "batch", "length", "act_kv_heads", "head_dim")
    v = sharding.constrain(v, "batch", "length", "act_kv_heads", "head_dim")
    inv_freq, attention_factor = rope.rope_tables(cfg)
    q = rope.apply_rope(q, inp.positions, inv_freq, attention_factor)
    k = rope.apply_rope(k, inp.positions, inv_freq, attention_factor)
    if cfg.llama_4_scaling_beta:
      sp = inp.positions if inp.scale_positions is None else inp.scale_positions
      q = q * rope.llama4_query_scale(sp, cfg).astype(q.dtype)[..., None, None]
    positions = inp.positions
    if inp.ragged is not None:  # packed [1, T] -> the row layout [R, Qrow] the cache and the block masks index
      rows = lambda x: x[0][inp.ragged.token]
      q, k, v, positions = rows(q), rows(k), rows(v), rows(positions)
    if inp.kv_write is not None:
      # commit, then attend (the prefix read masks positions >= prefix_len): writing first lets XLA update the
      # carried pages in place, where read-then-write made it copy the cache
      cache = KVCache(*write_block(cache.k, cache.v, k, v, inp.page_table, positions, inp.kv_write, layer,
                                   as_rows=attention_dispatch.tracing_platform() == "tpu"))
    if inp.train_block_size:
      out = attn_lib.sbd_training_attention(q, k, v, inp.train_block_size, cfg.head_dim ** -0.5,
                                            draft_head.block_mask(inp.train_draft_head, inp.train_block_size))
    else:
      out = attention_dispatch.block_attention(
        q, k, v, inp.block_mask, k_pages=cache.k if cache is not None else None,
        v_pages=cache.v if cache is not None else None,
        page_table=inp.page_table if inp.prefix_len is not None else None, prefix_len=inp.prefix_len,
        scale=cfg.head_dim ** -0.5, impl=getattr(self, "attention_impl", "reference"),
        layer=layer if cache is not None else None)
    if inp.ragged is not None:  # back to the packed tokens
      out = out.reshape(-1, *out.shape[2:])[inp.ragged.slot][None]
    out = sharding.constrain(out, "batch", "length", "act_heads", "head_dim")
    out = out.reshape(b, nq_tok, cfg.num_attention_heads * cfg.head_dim)
    return self.o_proj(out, *lora), cache


class MLP(nnx.Module):

  def __init__(self, cfg: NLDConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    h, i = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = _dense(rngs, h, i, dtype, param_dtype, lora_rank=_lora_rank(cfg, "gate_proj"))
    self.up_proj = _dense(rngs, h, i, dtype, param_dtype, lora_rank=_lora_rank(cfg, "up_proj"))
    self.down_proj = _dense(rngs, i, h, dtype, param_dtype, lora_rank=_lora_rank(cfg, "down_proj"))
    self.lora_scale = cfg.lora_scale

  def __call__(self, x, lora_mask: jax.Array | None = None):
    lora = lora_mask, self.lora_scale
    if hasattr(self, "gate_up_proj"):  # ProjectionFusion.FUSED
      gate_up = self.gate_up_proj(x, *lora)
      half = gate_up.shape[-1] // 2
      gate, up = gate_up[..., :half], gate_up[..., half:]
    else:
      gate, up = self.gate_proj(x, *lora), self.up_proj(x, *lora)
    return self.down_proj(jax.nn.silu(gate) * up, *lora)


class DecoderLayer(nnx.Module):

  def __init__(self, cfg: NLDConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
    self.self_attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
    self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, h, inp: ForwardInputs, cache: KVCache | None, layer: jax.Array | int):
    a, cache = self.self_attn(self.input_layernorm(h), inp, cache, layer)
    h = h + a
    h = h + self.mlp(self.post_attention_layernorm(h), inp.lora_mask if self.mlp.lora_scale else None)
    # the residual stream is replicated over tp: the all-reduces after o_proj and down_proj land here
    return sharding.constrain(h, "batch", "length", "act_embed"), cache


def stacked_layers(cfg: NLDConfig, *, dtype, param_dtype, rngs: nnx.Rngs) -> DecoderLayer:
  """`cfg.num_hidden_layers` decoder layers as one module whose weights carry a leading layer axis [L, ...] (each
  layer initialised from its own split of `rngs`). Call it through `NLDModel.hidden`'s scan, not directly."""

  @nnx.split_rngs(splits=cfg.num_hidden_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(layer_rngs: nnx.Rngs) -> DecoderLayer:
    return DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=layer_rngs)

  return make(rngs)


class NLDModel(nnx.Module):
  """NemotronLabsDiffusionModel: `encoder` (Ministral3 decoder stack) + untied `diffusion_head` (or, for a tied
  Llama, the embedding as the head)."""

  def __init__(self, cfg: NLDConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    self.cfg = cfg
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype,
                                  embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.layers = stacked_layers(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
    if not cfg.tie_word_embeddings:
      self.diffusion_head = _dense(rngs, cfg.hidden_size, cfg.vocab_size, dtype, param_dtype)

  def embed(self, tokens: jax.Array) -> jax.Array:
    """The embedding rows of `tokens` [b, Q] -> [b, Q, H]. A lookup of one token becomes a dynamic-slice, which
    XLA:GPU's SPMD partitioner serves by all-gathering the vocab-sharded table (NLD-8B at tp=2: 1 GiB in every
    decode step at batch 1); two rows stay a gather (a masked lookup in each shard, then an all-reduce)."""
    if tokens.size != 1:
      return self.embed_tokens(tokens)
    pair = jnp.concatenate([tokens.reshape(1), jnp.zeros((1,), tokens.dtype)])
    return self.embed_tokens(pair)[:1].reshape(tokens.shape + (self.cfg.hidden_size,))

  def hidden(self, inp: ForwardInputs, cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
    """Final-norm hidden states [b, Q, H] and the (possibly updated) cache."""
    h = sharding.constrain(self.embed(inp.tokens), "batch", "length", "act_embed")
    if isinstance(self.layers, nnx.List):  # LayerLoop.UNROLLED: each layer's own weights, a static layer index
      for i, layer in enumerate(self.layers):
        h, cache = layer(h, inp, cache, i)
      return self.norm(h), cache
    graphdef, stacked = nnx.split(self.layers)

    def one_layer(carry, xs):
      h, cache = carry
      weights, layer = xs
      h, cache = nnx.merge(graphdef, weights)(h, inp, cache, layer)
      return (h, cache), None

    # the whole cache is carried (not scanned over): each layer scatters into / gathers from its slice in place
    layer_ids = jnp.arange(self.cfg.num_hidden_layers, dtype=jnp.int32)
    (h, cache), _ = jax.lax.scan(one_layer, (h, cache), (stacked, layer_ids))
    return self.norm(h), cache

  def logits(self, h: jax.Array) -> jax.Array:
    # vocab-sharded under a tp mesh: softmax/argmax reduce over the split vocabulary (see sharding.py)
    if self.cfg.tie_word_embeddings:
      if hasattr(self, "tied_head_in_out") and math.prod(h.shape[:-1]) == 1:  # (see KernelLayout.OUT_IN)
        out = h @ self.tied_head_in_out[...]
      else:
        # the [V, H] embedding is an OUT_IN kernel as it is held; IN_OUT models (accelerators, meshes) skip the swap
        emb = self.embed_tokens.embedding[...].astype(h.dtype)
        if kernel_layout_of(self) is KernelLayout.OUT_IN:
          out = matmul_out_in(h, emb)
        else:
          out = jax.lax.dot_general(h, emb, (((h.ndim - 1,), (1,)), ((), ())))
    else:
      out = self.diffusion_head(h)
    return sharding.constrain(out.astype(jnp.float32), "batch", "length", "vocab")

  def __call__(self, inp: ForwardInputs, cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
    h, cache = self.hidden(inp, cache)
    return self.logits(h), cache

  def new_cache(self, num_pages: int, page_size: int, dtype=None) -> KVCache:
    cfg = self.cfg
    dtype = dtype or self.embed_tokens.embedding[...].dtype
    return KVCache.create(cfg.num_hidden_layers, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim, dtype)


def layer_loop_of(model: NLDModel) -> LayerLoop:
  return LayerLoop.UNROLLED if isinstance(model.layers, nnx.List) else LayerLoop.SCAN


def resolve_layer_loop(loop: LayerLoop | str, model: NLDModel, mesh=None, cache_bytes: int | None = None,
                       variants: int | None = None) -> LayerLoop:
  """AUTO -> UNROLLED on GPUs (concrete weights there, or abstract ones compiled for a GPU mesh), and for concrete
  weights on a CPU device with no mesh that exceed `cache_bytes` (default: the host's last-level cache; unknown:
  never) when the process has the memory mappings for `variants` unrolled step variants (unknown: assumed); else
  SCAN (see `LayerLoop`)."""
  loop = LayerLoop.parse(loop)
  if loop is not LayerLoop.AUTO:
    return loop
  platform = weights_platform(model)
  if platform in ("gpu", "cuda") or (platform is None and sharding.mesh_platform(mesh) in ("gpu", "cuda")):
    return LayerLoop.UNROLLED if _room_to_unroll(model) else LayerLoop.SCAN
  if platform != "cpu" or mesh is not None:
    return LayerLoop.SCAN
  cache_bytes = host_cpu.last_level_cache_bytes() if cache_bytes is None else cache_bytes
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  if cache_bytes is None or weight_bytes <= cache_bytes:
    return LayerLoop.SCAN
  return LayerLoop.UNROLLED if _mappings_to_unroll(model.cfg.num_hidden_layers, variants) else LayerLoop.SCAN


def _mappings_to_unroll(num_layers: int, variants: int | None) -> bool:
  """Whether `variants` step variants with unrolled layers fit in the memory mappings this process has left: each
  unrolled layer adds its own kernels' code mappings to every variant (XLA:CPU), and past Linux's limit compiles
  are refused (runtime/compilation.py). Scanned layers then let the same variants compile."""
  room = compilation.mapping_room()
  if variants is None or room is None:
    return True
  need = variants * compilation.variant_mappings(num_layers, unrolled=True)
  if need <= room:
    return True
  logging.getLogger(__name__).warning(
      "--layer_loop auto: %d step variants with %d unrolled layers would take ~%d memory mappings, %d are left "
      "under vm.max_map_count; running the layers scanned (~%d), slower on this CPU. To unroll, raise the limit "
      "(sysctl -w vm.max_map_count=262144) or serve fewer variants (a smaller --max_num_seqs)", variants,
      num_layers, need, room, variants * compilation.variant_mappings(num_layers, unrolled=False))
  return False


def _room_to_unroll(model: NLDModel, memory_stats=lambda device: device.memory_stats()) -> bool:
  """Whether each device holding the stacked layer weights has the memory to copy them into per-layer buffers
  (unrolling holds both until the stacked arrays are freed); abstract weights and devices without memory stats:
  yes."""
  need: dict = {}
  for x in jax.tree.leaves(nnx.state(model.layers, nnx.Param)):
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
      return True
    for shard in x.addressable_shards:
      need[shard.device] = need.get(shard.device, 0) + shard.data.nbytes
  for device, nbytes in need.items():
    stats = memory_stats(device)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) if stats and "bytes_limit" in stats else None
    if free is not None and free < 1.05 * nbytes:
      logging.getLogger(__name__).warning(
          "--layer_loop auto: %s has %.2f GB free, the unrolled copy of the layers needs %.2f GB; keeping the "
          "scanned layers", device, free / 1e9, nbytes / 1e9)
      return False
  return True


def weights_platform(model: NLDModel) -> str | None:
  """The platform ("cpu", "gpu", "tpu") the model's weights live on; None for abstract weights."""
  leaf = jax.tree.leaves(nnx.state(model.embed_tokens, nnx.Param))[0]
  return next(iter(leaf.devices())).platform if isinstance(leaf, jax.Array) else None


def with_layer_loop(model: NLDModel, loop: LayerLoop | str) -> NLDModel:
  """`model` with its decoder layers held for `loop` (AUTO resolved with no mesh): the same model when they
  already are, else a new NLDModel sharing every other weight whose layers are split into one module per layer
  (UNROLLED; each row copied into its own buffer, so the stacked arrays can be freed) or stacked back (SCAN). The
  forward computes the same function either way."""
  loop = resolve_layer_loop(loop, model)
  if loop is layer_loop_of(model):
    return model
  graphdef, state = nnx.split(model.layers)
  num_layers = model.cfg.num_hidden_layers
  if loop is LayerLoop.UNROLLED:
    def row(x, i):  # layer i's weight, on the sharding of the stacked one without its layer axis
      stacked = getattr(x, "sharding", None)
      placed = (jax.sharding.NamedSharding(stacked.mesh, jax.sharding.PartitionSpec(*tuple(stacked.spec)[1:]))
                if isinstance(stacked, jax.sharding.NamedSharding) else None)
      if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=placed)
      return x[i] if placed is None else jax.device_put(x[i], placed)
    layers = nnx.List([nnx.merge(graphdef, jax.tree.map(lambda x: row(x, i), state)) for i in range(num_layers)])
  else:
    per_layer = [nnx.split(layer)[1] for layer in model.layers]
    graphdef = nnx.split(model.layers[0])[0]
    def stack(*xs):
      if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs),) + xs[0].shape, xs[0].dtype)
      return jnp.stack(xs)
    layers = nnx.merge(graphdef, jax.tree.map(stack, *per_layer))
  arranged = nnx.merge(*nnx.split(model))  # a new module tree over the same arrays
  arranged.layers = layers
  return arranged


def kernel_layout_of(model: NLDModel) -> KernelLayout:
  first = model.layers[0] if isinstance(model.layers, nnx.List) else model.layers
  return first.self_attn.o_proj.kernel_layout  # every Dense holds the same layout (with_kernel_layout sets all)


def _cpu_without_mesh(model: NLDModel, mesh) -> bool:
  """Where the CPU-tuned arrangements apply under AUTO: concrete weights on a CPU device, no mesh."""
  return weights_platform(model) == "cpu" and mesh is None


def resolve_kernel_layout(layout: KernelLayout | str, model: NLDModel, mesh=None) -> KernelLayout:
  """AUTO -> OUT_IN for concrete weights on a CPU device with no mesh, else IN_OUT (see `KernelLayout`)."""
  layout = KernelLayout.parse(layout)
  if layout is not KernelLayout.AUTO:
    return layout
  return KernelLayout.OUT_IN if _cpu_without_mesh(model, mesh) else KernelLayout.IN_OUT


def with_kernel_layout(model: NLDModel, layout: KernelLayout | str) -> NLDModel:
  """`model` with every dense kernel held for `layout` (AUTO resolved with no mesh): the same model when they
  already are, else a new NLDModel sharing every other weight whose kernels are transposed copies (the old
  buffers can be freed). The forward computes the same function either way (up to the order of its sums)."""
  layout = resolve_kernel_layout(layout, model)
  if layout is kernel_layout_of(model):
    return model

  def transpose(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape[:-2] + x.shape[-2:][::-1], x.dtype)
    return jnp.swapaxes(x, -1, -2)  # a new buffer: the old one is freed with the model it came from

  arranged = nnx.merge(*nnx.split(model))  # a new module tree over the same arrays
  for _, module in list(nnx.iter_modules(arranged)):
    if isinstance(module, Dense):
      module.kernel = nnx.Param(transpose(module.kernel.get_value()))
      module.kernel_layout = layout
  embedding = arranged.embed_tokens.embedding.get_value()
  if layout is KernelLayout.OUT_IN and arranged.cfg.tie_word_embeddings and embedding.dtype == jnp.float32:
    arranged.tied_head_in_out = nnx.Param(transpose(embedding))
  elif hasattr(arranged, "tied_head_in_out"):
    del arranged.tied_head_in_out
  return arranged


def projection_fusion_of(model: NLDModel) -> ProjectionFusion:
  first = model.layers[0] if isinstance(model.layers, nnx.List) else model.layers
  return ProjectionFusion.FUSED if hasattr(first.self_attn, "qkv_proj") else ProjectionFusion.SEPARATE


def resolve_projection_fusion(fusion: ProjectionFusion | str, model: NLDModel, mesh=None) -> ProjectionFusion:
  """AUTO -> FUSED for concrete weights on a CPU device with no mesh, else SEPARATE (see `ProjectionFusion`)."""
  fusion = ProjectionFusion.parse(fusion)
  if fusion is ProjectionFusion.AUTO:
    return ProjectionFusion.FUSED if _cpu_without_mesh(model, mesh) else ProjectionFusion.SEPARATE
  if fusion is ProjectionFusion.FUSED and mesh is not None:
    raise ValueError("projection_fusion=fused cannot run under a mesh (a fused output axis would split over the tp "
                     "shards unevenly); use separate or auto")
  return fusion


def _part_sizes(cfg: NLDConfig, part_names: tuple[str, ...]) -> list[int]:
  q, kv, i = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
  return [{"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": i, "up_proj": i}[n] for n in part_names]


def _arrays_op(fn, *xs):
  """fn over arrays, or its abstract result over jax.ShapeDtypeStructs (an abstract model stays abstract)."""
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(xs)):
    return jax.eval_shape(fn, *xs)
  return fn(*xs)


def _fused_dense(parts: list[Dense], sizes: list[int]) -> Dense:
  """One Dense computing `parts` side by side along the output axis (their draft LoRAs too: A matrices side by
  side, B block-diagonal; a part without one gets zeros)."""
  out_axis = -1 if parts[0].kernel_layout is KernelLayout.IN_OUT else -2
  fused = nnx.merge(*nnx.split(parts[0]))  # the first part's settings (dtype, precision, layout); new arrays below
  fused.kernel = nnx.Param(_arrays_op(lambda *ks: jnp.concatenate(ks, axis=out_axis),
                                      *[p.kernel.get_value() for p in parts]))
  fused.out_features = sum(sizes)
  lora = [p for p in parts if hasattr(p, "lora_a")]
  if lora:
    a0 = lora[0].lora_a.get_value()
    lead, rank = a0.shape[:-2], a0.shape[-1]

    def join(lora_a, lora_b):  # the factors of the parts that have them, in part order
      a_of, b_of = iter(lora_a), iter(lora_b)
      a = [next(a_of) if hasattr(p, "lora_a") else jnp.zeros((*lead, a0.shape[-2], rank), a0.dtype) for p in parts]
      b = jnp.zeros((*lead, rank * len(parts), sum(sizes)), a0.dtype)
      for j, (p, start, size) in enumerate(zip(parts, [0, *itertools.accumulate(sizes)], sizes)):
        if hasattr(p, "lora_a"):
          b = b.at[..., j * rank:(j + 1) * rank, start:start + size].set(next(b_of))
      return jnp.concatenate(a, axis=-1), b
    fused.lora_a, fused.lora_b = (nnx.Param(x) for x in _arrays_op(
        join, [p.lora_a.get_value() for p in lora], [p.lora_b.get_value() for p in lora]))
  return fused


def _split_dense(fused: Dense, sizes: list[int], lora_parts: list[bool]) -> list[Dense]:
  """`_fused_dense`'s inverse: the parts, each with its draft LoRA where `lora_parts` says it has one."""
  out_axis = -1 if fused.kernel_layout is KernelLayout.IN_OUT else -2
  bounds = list(itertools.accumulate(sizes))[:-1]
  kernels = _arrays_op(lambda k: jnp.split(k, bounds, axis=out_axis), fused.kernel.get_value())
  if hasattr(fused, "lora_a"):
    rank = fused.lora_a.shape[-1] // len(sizes)
    starts = [0, *bounds]

    def blocks(a, b):
      return ([a[..., j * rank:(j + 1) * rank] for j in range(len(sizes))],
              [b[..., j * rank:(j + 1) * rank, s:s + n] for j, (s, n) in enumerate(zip(starts, sizes))])
    lora_a, lora_b = _arrays_op(blocks, fused.lora_a.get_value(), fused.lora_b.get_value())
  parts = []
  for j, (kernel, size) in enumerate(zip(kernels, sizes)):
    part = nnx.merge(*nnx.split(fused))
    part.kernel, part.out_features = nnx.Param(kernel), size
    if hasattr(fused, "lora_a"):
      if lora_parts[j]:
        part.lora_a, part.lora_b = nnx.Param(lora_a[j]), nnx.Param(lora_b[j])
      else:
        del part.lora_a, part.lora_b
    parts.append(part)
  return parts


def with_projection_fusion(model: NLDModel, fusion: ProjectionFusion | str) -> NLDModel:
  """`model` with its projections held for `fusion` (AUTO resolved with no mesh): the same model when they already
  are, else a new NLDModel sharing every other weight whose fused (or split) projections are new buffers (the old
  ones can be freed). The forward computes the same function either way (up to the order of its sums)."""
  fusion = resolve_projection_fusion(fusion, model)
  if fusion is projection_fusion_of(model):
    return model
  arranged = nnx.merge(*nnx.split(model))  # a new module tree over the same arrays
  cfg = arranged.cfg
  for layer in (arranged.layers if isinstance(arranged.layers, nnx.List) else [arranged.layers]):
    for module_name, fused_name, part_names in FUSED_PROJECTIONS:
      module, sizes = getattr(layer, module_name), _part_sizes(cfg, part_names)
      if fusion is ProjectionFusion.FUSED:
        setattr(module, fused_name, _fused_dense([getattr(module, n) for n in part_names], sizes))
        for name in part_names:
          delattr(module, name)
      else:
        lora_parts = [_lora_rank(cfg, n) > 0 for n in part_names]
        for name, part in zip(part_names, _split_dense(getattr(module, fused_name), sizes, lora_parts)):
          setattr(module, name, part)
        delattr(module, fused_name)
  return arranged


def model_from_params(cfg: NLDConfig, flat: dict, *, dtype, attention_impl: str | None = None) -> NLDModel:
  """An NLDModel of `cfg` holding the flat {name: array} weights as they are (wherever they live: one device or
  their mesh shards); `dtype` is the compute dtype."""
  model = nnx.eval_shape(lambda: NLDModel(cfg, dtype=dtype, param_dtype=dtype))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, unflatten_params(state.to_pure_dict(), flat))
  nnx.update(model, state)
  if attention_impl is not None:
    model.layers.self_attn.attention_impl = attention_impl
  return model


def shard_model(model: NLDModel, mesh: jax.sharding.Mesh) -> NLDModel:
  """The same model with its weights placed on `mesh` by sharding.py's rules (KV heads replicated when tp exceeds
  them, the config changed to match: an exactly equivalent model, its layers stacked). The attention choice is
  kept."""
  # the sharding rules name the stacked weights, [in, out]
  model = with_kernel_layout(with_layer_loop(model, LayerLoop.SCAN), KernelLayout.IN_OUT)
  run_cfg, placed = sharding.place_params(flatten_params(nnx.state(model, nnx.Param).to_pure_dict()), model.cfg, mesh)
  return model_from_params(run_cfg, placed, dtype=model.embed_tokens.dtype,
                           attention_impl=getattr(model.layers.self_attn, "attention_impl", None))


def abstract_model(cfg: NLDConfig, mesh=None, *, dtype=jnp.bfloat16, attention_impl: str | None = None) -> NLDModel:
  """An NLDModel of `cfg` whose weights are `jax.ShapeDtypeStruct`s (nothing allocated). With `mesh` (a device
  mesh or an AbstractMesh) the config is the mesh's (`sharding.mesh_config`) and every weight carries its
  NamedSharding, so a runner over it lowers the sharded program (for this host or, with an AbstractMesh, another
  platform)."""
  if mesh is not None:
    cfg = sharding.mesh_config(cfg, sharding.mesh_size(mesh, sharding.TP))
  model = nnx.eval_shape(lambda: NLDModel(cfg, dtype=dtype, param_dtype=dtype))
  if mesh is not None:
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, sharding.abstract_state(state, mesh))
  if attention_impl is not None:
    model.layers.self_attn.attention_impl = attention_impl
  return model
