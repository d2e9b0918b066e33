"""The pure step functions over (model weights, paged KV cache, small per-request arrays), one per `StepKind`, their
typed inputs (one registered-dataclass pytree per kind) and the example inputs each variant is lowered with.

Every function takes `(weights, cache, inputs)`, `weights` the leaves of the model's `nnx.State` in flatten order
(a call then passes a flat list of arrays: flattening a State of Variables on every call costs milliseconds of host
time at hundreds of weights); kinds that write K/V return the new cache first (the runner donates the old one), and
everything else they return is small ([b], [b, B], [b, B, K]) except the draft distributions, which stay on the
device until the verify that consumes them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.common import causal_mask
from recguide_jax.model import draft_head
from recguide_jax.model.config import DraftHead
from recguide_jax.model.nld import ForwardInputs, NLDModel, RaggedLayout
from recguide_jax.parallel import sharding
from recguide_jax.runtime import sampling
from recguide_jax.runtime.step_key import StepKey, StepKind
from recguide_jax.runtime.uncertainty import draft_signals, verifier_entropy


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
  """Per-row sampling parameters of a padded batch (numpy on the host; a pytree, so a step takes it whole)."""
  temperature: np.ndarray  # [b] float32
  top_k: np.ndarray  # [b] int32
  top_p: np.ndarray  # [b] float32
  keys: np.ndarray  # [b, 2] uint32
  # [b] int32: top logprobs each row reads (SamplingParams.logprobs; 0 none): a step computes the top entries only
  # when some row does
  top_logprobs: np.ndarray
  # the batch's sampling controls (numpy leaves), None when no row sets any: the steps then skip them entirely
  controls: sampling.Controls | None = None

  @classmethod
  def greedy(cls, b: int) -> "SamplingArrays":
    return cls(np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32), np.zeros((b, 2), np.uint32),
               np.zeros(b, np.int32))

  @property
  def controls_len(self) -> int:
    """The StepKey's `controls`: each row's control list length (0 without controls)."""
    return 0 if self.controls is None else int(self.controls.ids.shape[1])


def empty_controls(b: int, length: int, vocab_size: int) -> sampling.Controls:
  """Neutral controls of b rows with `length` padding entries each (ids = vocab_size, which the scatters drop)."""
  f32 = lambda v: np.full((b,), v, np.float32)
  return sampling.Controls(f32(0), f32(0), f32(1), f32(0), np.zeros(b, np.int32),
                           np.full((b, length), vocab_size, np.int32), np.zeros((b, length), np.float32),
                           np.zeros((b, length), bool), np.zeros((b, length), np.float32), np.zeros((b, length), bool))


def unpack_sampling(samp: SamplingArrays):
  """-> (temperature, top_k, top_p, keys, top_logprobs, controls or None)."""
  return samp.temperature, samp.top_k, samp.top_p, samp.keys, samp.top_logprobs, samp.controls


# ---- typed step inputs: one pytree per step kind (after the weights and the cache) --------------------------------
# [b] rows unless noted; P = pages per sequence. Field order is the order the compiled program takes its leaves in.
def _step_inputs(cls):
  return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_step_inputs
class PrefillInputs:
  """PREFILL (and SCORE, with `targets`): a prompt chunk."""
  tokens: Any  # [b, chunk] int32
  valid: Any  # [b, chunk] bool: the chunk's real tokens (their K/V are written)
  prefix_len: Any  # int32: tokens already in the cache
  page_table: Any  # [b, P] int32
  last_idx: Any  # int32: each row's last valid token, whose next token is sampled
  samp: SamplingArrays
  targets: Any = None  # SCORE: [b, chunk] int32, the prompt token after each position


@_step_inputs
class DraftInputs:
  """DRAFT: a block of B from each row's seed token."""
  seed: Any  # int32
  prefix_len: Any
  page_table: Any
  samp: SamplingArrays


@_step_inputs
class VerifyInputs:
  """VERIFY: the drafted blocks against their draft distributions."""
  tokens: Any  # [b, B] int32
  q: Any  # [b, B, V] float32, a DRAFT's output (on the device)
  write: Any  # bool: rows whose K/V are written
  prefix_len: Any
  page_table: Any
  samp: SamplingArrays


@_step_inputs
class DecodeInputs:
  """DECODE: AR steps from each row's seed token."""
  tokens: Any  # [b, 1] int32
  write: Any
  prefix_len: Any
  page_table: Any
  samp: SamplingArrays


@_step_inputs
class FusedInputs:
  """FUSED and GVERIFY: a greedy verify of tokens[:, :B] plus the tree's branch blocks, qn = (1 + slots) B."""
  tokens: Any  # [b, qn] int32
  positions: Any  # [b, qn] int32
  mask: Any  # [b, qn, qn] bool
  lora: Any  # [b, qn] bool: the draft adapter's tokens
  write: Any  # [b, qn] bool
  prefix_len: Any
  page_table: Any
  samp: SamplingArrays


@_step_inputs
class DenoiseInputs:
  """DENOISE: NLD block diffusion of a block from each row's seed token."""
  seed: Any
  prefix_len: Any
  page_table: Any
  threshold: Any  # float32
  samp: SamplingArrays
  active: Any  # bool: rows that denoise


@_step_inputs
class RaggedDraftInputs:
  """RAGGED_DRAFT: each row's draft at its own block row_len (0: none)."""
  seed: Any
  row_len: Any  # int32
  prefix_len: Any
  page_table: Any
  samp: SamplingArrays


@_step_inputs
class RaggedVerifyInputs:
  """RAGGED_VERIFY: each row's block at its own length row_len, in the row layout [R, W]."""
  drafted: Any  # [R, W] int32
  q: Any  # [R, W, V] float32
  seed: Any
  row_len: Any
  write: Any
  prefix_len: Any
  page_table: Any
  samp: SamplingArrays


def with_next_inputs(fn: Callable, decode: bool = False) -> Callable:
  """A verify (plain or ragged) or decode step that also returns the next call's inputs: its seed (the last
  committed token; [b, 1] for a decode, which takes [b, 1] seeds, [b] for a verify, whose next call is a draft) and
  committed lengths. A pipelined engine dispatches the next call from them before it reads this one back, with no
  op between the two calls (nothing to compile after warm-up, no extra dispatch)."""

  def chained(weights, cache, inputs: VerifyInputs | DecodeInputs):
    cache, accepted, out, *rest = fn(weights, cache, inputs)
    prefix_len = inputs.prefix_len
    if decode:
      seed = out[:, -1:]
    else:
      seed = jnp.take_along_axis(out, (accepted - 1)[:, None], axis=1)[:, 0]
    return (cache, accepted, out, *rest, seed, prefix_len + accepted)

  return chained


@dataclasses.dataclass(frozen=True)
class StepFunctions:
  """Builds the step function of a `StepKey` for one model graph (`nnx.split`'s graphdef, and the treedef of its
  state, whose leaves the step functions take) and acceptance rule."""
  cfg: Any  # NLDConfig
  graphdef: Any
  state_def: Any  # jax.tree.structure of the nnx.State
  rule: str

  def _model(self, weights) -> NLDModel:
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.state_def, weights))

  def build(self, key: StepKey) -> Callable:
    if key.kind == StepKind.PREFILL:
      return self._prefill(key.block)
    if key.kind == StepKind.SCORE:
      return self._prefill(key.block, score=True)
    if key.kind == StepKind.DRAFT:
      return self._draft(key.block)
    if key.kind == StepKind.VERIFY:
      return with_next_inputs(self._verify(key.block))
    if key.kind == StepKind.DECODE:
      return with_next_inputs(self._decode(key.steps), decode=True)
    if key.kind in (StepKind.FUSED, StepKind.GVERIFY):
      return self._fused(key.block, key.slots)
    if key.kind == StepKind.DENOISE:
      return self._denoise(key.block)
    if key.kind == StepKind.RAGGED_DRAFT:
      return self._ragged_draft(key.block, key.tokens)
    if key.kind == StepKind.RAGGED_VERIFY:
      return with_next_inputs(self._ragged_verify(key.block, key.tokens))
    raise ValueError(f"no step function for {key}")

  # ---- one function per kind -----------------------------------------------------------------------------------
  def _prefill(self, chunk: int, score: bool = False):
    """A causal prompt chunk: writes the K/V of its valid tokens and samples the next token at each row's last
    one. With `score` it also takes `targets` [b, chunk] (the prompt token after each position) and returns their
    raw logprobs [b, chunk] and the top entries [b, chunk, K]: the logits of the whole chunk are built in slices
    of SCORE_SLICE positions, so the step's peak holds [b, SCORE_SLICE, V] logits, and only the small results
    leave the device."""
    cfg = self.cfg
    mask = jnp.asarray(causal_mask(chunk))

    def fn(weights, cache, inputs: PrefillInputs):
      tokens, valid, prefix_len, page_table, last_idx = (inputs.tokens, inputs.valid, inputs.prefix_len,
                                                         inputs.page_table, inputs.last_idx)
      temperature, top_k, top_p, keys, top_logprobs, controls = unpack_sampling(inputs.samp)
      positions = prefix_len[:, None] + jnp.arange(chunk)[None, :]
      inp = ForwardInputs(tokens=tokens, positions=positions, block_mask=mask, prefix_len=prefix_len,
                          page_table=page_table, kv_write=valid)
      model = self._model(weights)
      h, cache = model.hidden(inp, cache)
      h_last = jnp.take_along_axis(h, last_idx[:, None, None], axis=1)  # only the last valid token's logits
      logits = model.logits(h_last)  # [b, 1, V]
      probs = sampling.processed_probs(logits, temperature, top_k, top_p, cfg.mask_token_id, controls)
      tok = sampling.draw(sampling.stream_keys(keys, sampling.PREFILL_STREAM), probs, temperature <= 0)  # [b, 1]
      lp, top_lp, top_ids = sampling.raw_logprobs(logits, tok, cfg.mask_token_id, top_logprobs)
      out = (cache, tok[:, 0], lp[:, 0], top_lp[:, 0], top_ids[:, 0])
      if not score:
        return out
      return out + score_chunk(model, h, inputs.targets, cfg.mask_token_id)

    return fn

  def _draft(self, blk: int):
    cfg = self.cfg
    mask = jnp.asarray(draft_head.block_mask(cfg.draft_head, blk))

    def fn(weights, cache, inputs: DraftInputs):
      seed, prefix_len, page_table = inputs.seed, inputs.prefix_len, inputs.page_table
      b = seed.shape[0]
      tokens = jnp.full((b, blk), cfg.mask_token_id, jnp.int32).at[:, 0].set(seed)
      positions = prefix_len[:, None] + jnp.arange(blk)[None, :]
      lora_mask = draft_head.adapter_rows(cfg.draft_head, tokens, cfg.mask_token_id) if cfg.lora_rank else None
      inp = ForwardInputs(tokens=tokens, positions=positions, block_mask=mask, prefix_len=prefix_len,
                          page_table=page_table, lora_mask=lora_mask)
      model = self._model(weights)
      h, _ = model.hidden(inp, cache)
      return drafted_block(cfg, model.logits, draft_head.align(cfg.draft_head, h, blk), seed, inputs.samp)

    return fn

  def _verify_body(self, blk: int):
    """VERIFY's computation on unpacked arguments (DECODE runs it per step with its own keys and tokens)."""
    cfg, rule = self.cfg, self.rule
    mask = jnp.asarray(causal_mask(blk))

    def body(weights, cache, tokens, q, write, prefix_len, page_table, samp, extra=None, offset=0):
      positions = prefix_len[:, None] + jnp.arange(blk)[None, :]
      inp = ForwardInputs(tokens=tokens, positions=positions, block_mask=mask, prefix_len=prefix_len,
                          page_table=page_table, kv_write=jnp.broadcast_to(write[:, None], tokens.shape))
      model = self._model(weights)
      h, cache = model.hidden(inp, cache)
      # AR decode (q None): a block of 1 has no draft token, so acceptance only draws the bonus token from p
      return (cache,) + verified_block(cfg, rule, model.logits, h, tokens, q, samp, extra, offset)

    return body

  def _verify(self, blk: int):
    body = self._verify_body(blk)
    return lambda weights, cache, inputs: body(weights, cache, inputs.tokens, inputs.q, inputs.write,
                                               inputs.prefix_len, inputs.page_table, inputs.samp)

  def _decode(self, steps: int = 1):
    """`steps` AR decode forwards in one call: each writes its input token's K/V and samples the next one, which
    the next step takes as input on the device. Step s samples with round counter keys[:, 1] + s, so the tokens are
    those of `steps` single-step calls whose counters advance by one (sampled or greedy). Results are [b, steps]
    (top entries [b, steps, K]); `accepted` is `steps` for every row (the host stops each request at its own stop
    condition and drops what the later steps wrote)."""
    verify = self._verify_body(1)

    def fn(weights, cache, inputs: DecodeInputs):
      tokens, write, prefix_len, page_table, samp = (inputs.tokens, inputs.write, inputs.prefix_len,
                                                     inputs.page_table, inputs.samp)
      if steps == 1:
        return verify(weights, cache, tokens, None, write, prefix_len, page_table, samp)
      keys = samp.keys

      def step(carry, s):
        cache, tok, sampled = carry
        step_samp = dataclasses.replace(samp, keys=keys.at[:, 1].add(s.astype(keys.dtype)))
        # the controls of step s count the s tokens earlier steps sampled
        cache, _, out, lp, top_lp, top_ids, ent = verify(weights, cache, tok, None, write, prefix_len + s, page_table,
                                                         step_samp, extra=sampled, offset=s)
        sampled = jax.lax.dynamic_update_slice_in_dim(sampled, out, s, axis=1)
        return (cache, out, sampled), (out[:, 0], lp[:, 0], top_lp[:, 0], top_ids[:, 0], ent[:, 0])

      sampled = jnp.zeros((tokens.shape[0], steps), jnp.int32)
      (cache, _, _), per_step = jax.lax.scan(step, (cache, tokens, sampled), jnp.arange(steps, dtype=jnp.int32))
      out, lp, top_lp, top_ids, ent = (jnp.moveaxis(y, 0, 1) for y in per_step)
      accepted = jnp.full(tokens.shape[:1], steps, jnp.int32)
      return cache, accepted, out, lp, top_lp, top_ids, ent

    return fn

  def _fused(self, blk: int, branches: int):
    """Greedy verify of the B draft tokens (causal, committed) and, in the same forward, drafts of up to
    `branches` prospective next blocks laid out as a tree by the caller (positions, mask, LoRA rows). With
    branches = 0 this is a greedy verify of host-provided draft tokens (GVERIFY)."""
    cfg = self.cfg

    def fn(weights, cache, inputs: FusedInputs):
      tokens, positions, mask, lora, write = inputs.tokens, inputs.positions, inputs.mask, inputs.lora, inputs.write
      prefix_len, page_table = inputs.prefix_len, inputs.page_table
      b = tokens.shape[0]
      inp = ForwardInputs(tokens=tokens, positions=positions, block_mask=mask, prefix_len=prefix_len,
                          page_table=page_table, kv_write=write, lora_mask=lora if cfg.lora_rank else None)
      model = self._model(weights)
      h, cache = model.hidden(inp, cache)
      if branches and cfg.draft_head is not DraftHead.SAME_POSITION:
        h = jnp.concatenate([h[:, :blk], draft_head.align(cfg.draft_head, h[:, blk:], blk)], axis=1)
      vocab = vocab_shard_size(cfg.vocab_size)
      # one head matmul over every position when its logits are small; else the verified block's and the
      # branches' each in position slices, so the step never holds [b, (1 + slots) B, V] float32 (issue 33: 1.9 GB
      # per v5e chip for NLD-8B at tp=4, batch 32, B=32)
      together = branches and position_slices(b, tokens.shape[1], vocab) == 1
      logits = model.logits(h) if together else None
      drafted = tokens[:, :blk]
      # the reference rule (accept while an independent verifier sample equals the draft) needs no draft
      # distribution, so no [b, B, V] point mass is built; for greedy rows it is "accept while the verifier's
      # argmax equals the draft", the same as every other rule
      src, logits_of = (logits[:, :blk], lambda x: x) if together else (h[:, :blk], model.logits)
      accepted, out, lp, top_lp, top_ids, ent = verified_block(cfg, "reference", logits_of, src, drafted, None,
                                                               inputs.samp)
      if not branches:
        return cache, accepted, out, lp, top_lp, top_ids, ent
      br_in = tokens[:, blk:]  # [b, slots * B]
      first = (jnp.arange(branches * blk) % blk == 0)[None, :]  # slot 0 of each branch block

      def branch_drafts(br_logits, in_slice, first_slice):
        br_tok = sampling.argmax(sampling.exclude_token(br_logits, cfg.mask_token_id))
        # a correction block keeps its alt token in slot 0; the continuation's slot 0 is the guessed bonus
        br_tok = jnp.where(first_slice & (in_slice != cfg.mask_token_id), in_slice, br_tok)
        return br_tok, draft_signals(br_logits, br_tok, cfg).swapaxes(1, 2)  # [b, w], [b, w, 3]

      first = jnp.broadcast_to(first, br_in.shape)
      if together:
        br_tok, sig = branch_drafts(logits[:, blk:], br_in, first)
      else:
        br_tok, sig = map_position_slices(lambda h_slice, *rest: branch_drafts(model.logits(h_slice), *rest),
                                          (h[:, blk:], br_in, first), vocab)
      if cfg.draft_head is DraftHead.NEXT_POSITION:  # a continuation's slot 0 (the bonus) is the verifier's own token
        br_tok = jnp.where(first & (br_in == cfg.mask_token_id), out[:, blk - 1:blk], br_tok)
      sig = sig.reshape(b, branches, blk, 3).swapaxes(2, 3)
      return (cache, accepted, out, lp, top_lp, top_ids, ent, br_tok.reshape(b, branches, blk), sig)

    return fn

  def _denoise(self, blk: int):
    """NLD `generate` inner loop: each iteration is one bidirectional forward; commit the most confident masked
    position plus every masked position whose confidence >= threshold; stop when no mask is left or an EOS has
    no mask before it. Rows whose loop is done stop changing; `steps` counts each row's forwards."""
    cfg = self.cfg
    mask = jnp.asarray(draft_head.block_mask(cfg.draft_head, blk))
    eos = jnp.asarray(cfg.eos_token_ids, jnp.int32)

    def fn(weights, cache, inputs: DenoiseInputs):
      seed, prefix_len, page_table, threshold, active = (inputs.seed, inputs.prefix_len, inputs.page_table,
                                                         inputs.threshold, inputs.active)
      # diffusion decoding reports no logprobs; the engine refuses sampling controls for it (no AR distribution)
      temperature, top_k, top_p, keys, _, _ = unpack_sampling(inputs.samp)
      b = seed.shape[0]
      model = self._model(weights)
      positions = prefix_len[:, None] + jnp.arange(blk)[None, :]
      tokens0 = jnp.full((b, blk), cfg.mask_token_id, jnp.int32).at[:, 0].set(seed)
      typed = jax.random.wrap_key_data(keys)

      def running(tokens):
        is_mask = tokens == cfg.mask_token_id
        is_eos = jnp.isin(tokens, eos)
        # an EOS with no mask before it ends the block
        masks_before = jnp.cumsum(is_mask, axis=1) - is_mask
        done_eos = jnp.any(is_eos & (masks_before == 0), axis=1)
        return jnp.any(is_mask, axis=1) & ~done_eos & active

      def cond(carry):
        tokens, steps, i = carry
        return jnp.any(running(tokens)) & (i < blk)

      def body(carry):
        tokens, steps, i = carry
        live = running(tokens)
        inp = ForwardInputs(tokens=tokens, positions=positions, block_mask=mask, prefix_len=prefix_len,
                            page_table=page_table)
        h, _ = model.hidden(inp, cache)
        logits = model.logits(draft_head.align(cfg.draft_head, h, blk))
        raw = jax.nn.softmax(sampling.exclude_token(logits, cfg.mask_token_id), axis=-1)
        probs = sampling.processed_probs(logits, temperature, top_k, top_p, cfg.mask_token_id)
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(typed)
        cand = jax.vmap(sampling.sample)(step_keys, probs)
        conf = jnp.take_along_axis(raw, cand[..., None], axis=-1)[..., 0]  # untempered confidence
        is_mask = tokens == cfg.mask_token_id
        conf = jnp.where(is_mask, conf, -jnp.inf)
        best = jnp.argmax(conf, axis=1)
        take = (conf >= threshold[:, None]) | (jnp.arange(blk)[None, :] == best[:, None])
        take = take & is_mask & live[:, None]
        tokens = jnp.where(take, cand, tokens)
        return tokens, steps + live.astype(jnp.int32), i + 1

      tokens, steps, _ = jax.lax.while_loop(cond, body, (tokens0, jnp.zeros((b,), jnp.int32), jnp.int32(0)))
      return tokens, steps

    return fn

  # ---- ragged steps: rows of their own block lengths packed into one token dimension ----------------------------
  def _ragged_draft(self, width: int, total: int):
    """LinearSS drafts of every row at its own block `row_len[r]` (0: no draft for that row) in one forward over
    `total` packed tokens: the same tokens, positions and bidirectional in-block mask as a DRAFT at block
    row_len[r], so the same draft. Results in the row layout [R, width] (q [R, width, V]), which the ragged verify
    reads."""
    cfg = self.cfg

    def fn(weights, cache, inputs: RaggedDraftInputs):
      seed, row_len, prefix_len, page_table = inputs.seed, inputs.row_len, inputs.prefix_len, inputs.page_table
      rows = seed.shape[0]
      layout, j = ragged_layout(row_len, width, total)
      prefix_len = jnp.where(row_len > 0, prefix_len, 0)  # a row with no draft reads no prefix
      tokens = jnp.full((rows, width), cfg.mask_token_id, jnp.int32).at[:, 0].set(seed)
      # [R, width, width]: the row's own block
      mask = jnp.asarray(draft_head.block_mask(cfg.draft_head, width))[None] & (
          jnp.arange(width)[None, None, :] < row_len[:, None, None])
      inp = ragged_inputs(layout, j, tokens, prefix_len, page_table, mask, None, None)
      if cfg.lora_rank:
        inp = dataclasses.replace(inp, lora_mask=draft_head.adapter_rows(cfg.draft_head, inp.tokens, cfg.mask_token_id))
      model = self._model(weights)
      h, _ = model.hidden(inp, cache)
      # the head runs on each row's slots [R, width] as DRAFT's does on its block
      return drafted_block(cfg, model.logits, draft_head.align(cfg.draft_head, h[0][layout.token], width), seed,
                           dataclasses.replace(inputs.samp, controls=None))

    return fn

  def _ragged_verify(self, width: int, total: int):
    """Every row's causal block at its own length `row_len[r]` in one forward over `total` packed tokens: a
    LinearSS row verifies its draft (row_len = its B) with acceptance capped at its own block, an AR row (row_len 1)
    decodes its seed token. Writes the K/V of the live rows' tokens. Results as VERIFY's, [R, width]."""
    cfg, rule = self.cfg, self.rule

    def fn(weights, cache, inputs: RaggedVerifyInputs):
      drafted, q, seed, row_len, write = inputs.drafted, inputs.q, inputs.seed, inputs.row_len, inputs.write
      prefix_len, page_table = inputs.prefix_len, inputs.page_table
      layout, j = ragged_layout(row_len, width, total)
      prefix_len = jnp.where(row_len > 0, prefix_len, 0)
      tokens = drafted.at[:, 0].set(seed)
      mask = jnp.asarray(causal_mask(width))[None] & (jnp.arange(width)[None, None, :] < row_len[:, None, None])
      kv_write = write[:, None] & (jnp.arange(width)[None, :] < row_len[:, None])
      inp = ragged_inputs(layout, j, tokens, prefix_len, page_table, mask, kv_write, None)
      model = self._model(weights)
      h, cache = model.hidden(inp, cache)
      # each row's slots [R, width] verified as VERIFY's blocks (position slices), acceptance capped at the row's
      # own block
      samp = dataclasses.replace(inputs.samp, controls=None)
      return (cache,) + verified_block(cfg, rule, model.logits, h[0][layout.token], tokens, q, samp,
                                       last=jnp.maximum(row_len, 1) - 1)

    return fn


def ragged_layout(row_len: jax.Array, width: int, total: int):
  """Rows of `row_len` [R] tokens each (at most `width`), packed back to back into `total` tokens (the rest is
  padding). -> (RaggedLayout, j [T]: each packed token's index in its row)."""
  rows = row_len.shape[0]
  starts = jnp.cumsum(row_len) - row_len  # [R] each row's first packed token
  t = jnp.arange(total)
  row = jnp.clip(jnp.searchsorted(jnp.cumsum(row_len), t, side="right"), 0, rows - 1)  # padding: the last row
  j = jnp.clip(t - starts[row], 0, width - 1)
  token = jnp.clip(starts[:, None] + jnp.arange(width)[None, :], 0, total - 1)  # empty slots: masked, unwritten
  return RaggedLayout(slot=(row * width + j).astype(jnp.int32), token=token.astype(jnp.int32)), j


def ragged_inputs(layout, j, tokens_rows, prefix_len, page_table, mask, kv_write, lora_mask) -> ForwardInputs:
  """ForwardInputs of a ragged forward: the packed tokens and positions [1, T] read off the row layout."""
  flat = layout.slot
  width = tokens_rows.shape[1]
  tokens = tokens_rows.reshape(-1)[flat][None]
  positions = (prefix_len[flat // width] + j)[None].astype(jnp.int32)
  return ForwardInputs(tokens=tokens, positions=positions, block_mask=mask, prefix_len=prefix_len,
                       page_table=page_table, kv_write=kv_write, lora_mask=lora_mask, ragged=layout)


# Position slices of a step's logits: a slice's [b, w, V / tp] float32 logits stay under LOGITS_SLICE_BYTES per
# device (the sampling pipeline after them keeps about eight arrays of their size live at once) while it has at
# least MIN_SLICE_ROWS rows (b * w), below which re-reading the head's weights once per slice would cost a
# memory-bound step more than the memory saved
LOGITS_SLICE_BYTES = 64 * 2 ** 20
MIN_SLICE_ROWS = 256


def vocab_shard_size(vocab: int) -> int:
  """Vocabulary entries of the logits on one device: split over tp under a mesh (model.logits' constraint)."""
  mesh = sharding.active_mesh()
  tp = sharding.mesh_size(mesh, sharding.TP) if mesh is not None else 1
  return vocab // tp if tp > 1 and vocab % tp == 0 else vocab


def position_slices(rows: int, positions: int, vocab: int) -> int:
  """How many equal slices the logits of `positions` positions of `rows` rows are built in (a divisor of
  `positions`): the fewest whose float32 logits fit LOGITS_SLICE_BYTES, but none thinner than MIN_SLICE_ROWS rows."""
  total, n = rows * positions * vocab * 4, 1
  for d in range(2, positions + 1):
    if total // n <= LOGITS_SLICE_BYTES:
      break
    if positions % d:
      continue
    if rows * (positions // d) < MIN_SLICE_ROWS:
      break
    n = d
  return n


def map_position_slices(fn: Callable, xs: tuple, vocab: int):
  """`fn` over slices of the position axis (axis 1) of the arrays `xs` ([b, T, ...]), one slice at a time (a loop
  over `position_slices` of them); its results ([b, w, ...], positions on axis 1) are written in place into
  [b, T, ...] arrays (stacking them and moving the slice axis back copied each result once more: a draft's
  [b, B, V / tp] distributions)."""
  b, t = xs[0].shape[:2]
  n = position_slices(b, t, vocab)
  if n == 1:
    return fn(*xs)
  w = t // n
  take = lambda i: tuple(jax.lax.dynamic_slice_in_dim(x, i * w, w, axis=1) for x in xs)
  shapes = jax.eval_shape(fn, *take(0))
  out = jax.tree.map(lambda s: jnp.zeros((b, t) + s.shape[2:], s.dtype), shapes)

  def body(i, out):
    return jax.tree.map(lambda o, y: jax.lax.dynamic_update_slice_in_dim(o, y, i * w, axis=1), out, fn(*take(i)))

  return jax.lax.fori_loop(0, n, body, out)


SCORE_SLICE = 16  # positions whose [b, SCORE_SLICE, V] logits a SCORE step holds at once


def score_chunk(model: NLDModel, h: jax.Array, targets: jax.Array, mask_token_id: int):
  """Raw logprobs of `targets` [b, T] under the logits of hidden states `h` [b, T, D], with the top entries:
  ([b, T], [b, T, K], [b, T, K]). The logits are built SCORE_SLICE positions at a time (a `lax.map` over slices)
  so a long chunk never holds [b, T, V] at once."""
  b, t, d = h.shape
  width = math.gcd(t, SCORE_SLICE)
  hs = h.reshape(b, t // width, width, d).swapaxes(0, 1)  # [slices, b, width, D]
  ts = targets.reshape(b, t // width, width).swapaxes(0, 1)

  def one(args):
    h_slice, t_slice = args
    return sampling.raw_logprobs(model.logits(h_slice), t_slice, mask_token_id)

  lp, top_lp, top_ids = jax.lax.map(one, (hs, ts))
  unslice = lambda x: x.swapaxes(0, 1).reshape((b, t) + x.shape[3:])
  return unslice(lp), unslice(top_lp), unslice(top_ids)


def drafted_block(cfg, logits_of: Callable, h: jax.Array, seed: jax.Array, samp: SamplingArrays):
  """Draft tokens [b, B] (the seed at index 0), distributions q [b, B, V] and signals [b, 3, B] of draft blocks
  whose head inputs are h [b, B, D] (aligned: index j drafts block token j), built a position slice at a time
  (`map_position_slices`, as `verified_block`; issue 33: the draft was the largest step left on a v5e chip, and a
  ragged step's [32, 32, V] float32 whole held 3.2 GB on a v6e for NLD-8B). The draft samples under the batch's
  controls as of the committed output (any draft distribution keeps the verify lossless; this one is closer to the
  verifier's, so more of it is accepted)."""
  temperature, top_k, top_p, keys, _, controls = unpack_sampling(samp)  # a draft reports no logprobs
  draft_keys = sampling.stream_keys(keys, sampling.DRAFT_STREAM)

  def one(h_slice, pos_slice):
    logits = logits_of(h_slice)
    q = sampling.processed_probs(logits, temperature, top_k, top_p, cfg.mask_token_id, controls)
    drafted = sampling.draw_per_position(draft_keys, q, pos_slice, temperature <= 0)
    drafted = jnp.where(pos_slice == 0, seed[:, None], drafted)
    return drafted, q, draft_signals(logits, drafted, cfg).swapaxes(1, 2)

  b, blk = h.shape[:2]
  pos = jnp.broadcast_to(jnp.arange(blk, dtype=jnp.int32)[None, :], (b, blk))
  drafted, q, signals = map_position_slices(one, (h, pos), vocab_shard_size(cfg.vocab_size))
  return drafted, q, signals.swapaxes(1, 2)


def verified_block(cfg, rule: str, logits_of: Callable, src: jax.Array, tokens: jax.Array, q: jax.Array | None,
                   samp: SamplingArrays, extra: jax.Array | None = None, offset=0, last: jax.Array | None = None):
  """Acceptance, emitted tokens, logprobs (with the top entries) and verifier entropy of verified blocks tokens
  [b, B] whose logits are `logits_of(src)` (src: the block's hidden states, or its logits with the identity):
  (accepted [b], out [b, B], lp [b, B], top_lp [b, B, K], top_ids [b, B, K], entropy [b, B]). The logits and
  every [b, w, V] array made from them are built a position slice at a time (`map_position_slices`): each position
  is decided on its own (sampling.position_verdicts), so slicing changes no token, and a batch of long blocks never
  holds its float32 distributions whole (issue 33: about eight [32, 32, V / 4] arrays, 1.1 GB per v5e chip for
  NLD-8B at tp=4). Position j follows the draft tokens 1..j (`extra`, default tokens[:, 1:]) under the controls.
  `last` [b]: each row's last block index where rows of shorter blocks share the layout (a ragged step; default
  B - 1): a row accepts nothing past it and draws its bonus there."""
  temperature, top_k, top_p, keys, top_logprobs, controls = unpack_sampling(samp)
  b, blk = tokens.shape
  greedy = temperature <= 0
  if extra is None and blk > 1:
    extra = tokens[:, 1:]
  last = jnp.full((b,), blk - 1, jnp.int32) if last is None else last.astype(jnp.int32)
  x, q_x, u = sampling.draft_tests(rule, keys, q, tokens)
  pos = jnp.broadcast_to(jnp.arange(blk, dtype=jnp.int32)[None, :], (b, blk))

  def one(src_slice, x_slice, pos_slice, q_x_slice, u_slice):
    logits = logits_of(src_slice)
    p = sampling.processed_probs(logits, temperature, top_k, top_p, cfg.mask_token_id, controls, extra,
                                 offset + pos_slice[0, 0])
    v = sampling.position_verdicts(rule, keys, p, x_slice, pos_slice, greedy, last, q, q_x_slice, u_slice)
    lp, top_lp, top_ids = sampling.raw_logprobs(logits, jnp.stack([x_slice, v.cand], axis=-1), cfg.mask_token_id,
                                                top_logprobs)
    return v.ok, v.cand, lp, top_lp, top_ids, verifier_entropy(logits, cfg)

  vocab = vocab_shard_size(cfg.vocab_size)
  ok, cand, lp, top_lp, top_ids, ent = map_position_slices(one, (src, x, pos, q_x, u), vocab)
  accepted, out = sampling.settle(rule, sampling.Verdicts(ok, cand), x)
  lp = jnp.where(out == cand, lp[..., 1], lp[..., 0])  # out: the candidate where the run ends, else draft tokens
  return accepted, out, lp, top_lp, top_ids, ent


def example_inputs(key: StepKey, pages_per_seq: int, vocab_size: int):
  """The typed inputs a variant is called with (after weights and cache), as zeros of their shapes and dtypes (the
  draft distributions of VERIFY as a `ShapeDtypeStruct`: they arrive from the device)."""
  b, blk, P = key.batch, key.block, pages_per_seq
  i32 = lambda *s: np.zeros(s, np.int32)
  samp = SamplingArrays.greedy(b)
  if key.controls:
    samp.controls = empty_controls(b, key.controls, vocab_size)
  if key.kind in (StepKind.PREFILL, StepKind.SCORE):
    return PrefillInputs(i32(b, blk), np.zeros((b, blk), bool), i32(b), i32(b, P), i32(b), samp,
                         i32(b, blk) if key.kind == StepKind.SCORE else None)
  if key.kind == StepKind.DRAFT:
    return DraftInputs(i32(b), i32(b), i32(b, P), samp)
  if key.kind == StepKind.DECODE:
    return DecodeInputs(i32(b, 1), np.zeros((b,), bool), i32(b), i32(b, P), samp)
  if key.kind == StepKind.VERIFY:
    q = jax.ShapeDtypeStruct((b, blk, vocab_size), jnp.float32)
    return VerifyInputs(i32(b, blk), q, np.zeros((b,), bool), i32(b), i32(b, P), samp)
  if key.kind in (StepKind.FUSED, StepKind.GVERIFY):
    qn = key.query_tokens
    return FusedInputs(i32(b, qn), i32(b, qn), np.zeros((b, qn, qn), bool), np.zeros((b, qn), bool),
                       np.zeros((b, qn), bool), i32(b), i32(b, P), samp)
  if key.kind == StepKind.DENOISE:
    return DenoiseInputs(i32(b), i32(b), i32(b, P), np.zeros(b, np.float32), samp, np.zeros(b, bool))
  if key.kind == StepKind.RAGGED_DRAFT:
    return RaggedDraftInputs(i32(b), i32(b), i32(b), i32(b, P), samp)
  if key.kind == StepKind.RAGGED_VERIFY:
    q = jax.ShapeDtypeStruct((b, blk, vocab_size), jnp.float32)
    return RaggedVerifyInputs(i32(b, blk), q, i32(b), i32(b), np.zeros((b,), bool), i32(b), i32(b, P), samp)
  raise ValueError(f"no inputs for {key}")
