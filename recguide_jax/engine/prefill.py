"""Prefill: a batch's next prompt chunk (the plain PREFILL variant, or SCORE for requests that asked for prompt
logprobs), and the sharing of one prompt's prefill among its n samples.

Samples of one prompt (`Engine.add_request(..., prefill_source=...)`) wait for the first one's prompt to be cached,
then take its full pages (`PageAllocator.fork`, reference-counted) and its prompt logprobs, and prefill only the
rest: at most a page, and always the last prompt token, whose forward samples their own first token with their
own seed. A sample whose source is gone before that prefills on its own.
"""

from __future__ import annotations

import time

import numpy as np

from recguide_jax.engine import output
from recguide_jax.engine.requests import Request
from recguide_jax.runtime.step_key import StepKind


def run_prefill(eng, reqs: list[Request], score: bool = False) -> None:
  """One prompt chunk of each of `reqs` (padded to a batch bucket); with `score`, the SCORE variant, which also
  returns each position's next-prompt-token logprob and top entries. Requests whose prompt is then cached emit
  their first token (or finish, with max_tokens 0)."""
  chunk = eng.rc.prefill_chunk
  alloc = eng.allocator
  done = [eng.prefilled(r) for r in reqs]  # prompt tokens cached so far: the allocator's committed length
  for r, d in zip(reqs, done):
    alloc.reserve(r.request_id, min(d + chunk, len(r.prompt_ids)))
  b = eng.runner.bucket_for(len(reqs))
  page_table = np.zeros((b, eng.rc.pages_per_seq), np.int32)  # zeros: TRASH_PAGE
  alloc.write_page_table([r.request_id for r in reqs], page_table)
  prefix_len = np.zeros((b,), np.int32)
  tokens = np.zeros((b, chunk), np.int32)
  valid = np.zeros((b, chunk), bool)
  last_idx = np.zeros((b,), np.int32)
  targets = np.zeros((b, chunk), np.int32) if score else None
  for i, (r, d) in enumerate(zip(reqs, done)):
    prefix_len[i] = d
    piece = r.prompt_ids[d:d + chunk]
    tokens[i, :len(piece)] = piece
    valid[i, :len(piece)] = True
    last_idx[i] = len(piece) - 1
    if score:  # position t scores the prompt token after it (the last prompt token's successor is generated)
      nxt = r.prompt_ids[d + 1:d + 1 + chunk]
      targets[i, :len(nxt)] = nxt
  samp = eng.sampling_arrays(reqs, eng.batch_rows(reqs), b)
  outs = eng.runner.prefill(tokens, valid, prefix_len, page_table, last_idx, samp, targets)
  tok, lp, top_lp, top_ids = outs[:4]
  eng.totals[f"forwards_{StepKind.PREFILL}"] += 1
  if eng.forward_log is not None:
    eng.forward_log.append((str(StepKind.PREFILL), chunk, len(reqs)))
  for i, (r, d) in enumerate(zip(reqs, done)):
    n = int(valid[i].sum())
    if score:
      output.append_prompt_logprobs(r, outs[4][i], outs[5][i], outs[6][i], n, d)
    r.round_counter += 1
    eng.totals["prompt_tokens"] += n  # live, for /metrics and the periodic stats line
    alloc.commit(r.request_id, d + n)
    alloc.register_prefix(r.request_id)  # its prompt's pages now full and committed join the prefix cache
    r.stats.forwards[StepKind.PREFILL] += 1
  # other samples of a prompt cached just now take its pages before its first token can finish it
  share_prefills(eng)
  for i, r in enumerate(reqs):
    if eng.prefilled(r) == len(r.prompt_ids):
      r.stats.ttft_s = time.perf_counter() - r.arrival
      if r.params.max_tokens == 0:  # only the prompt's logprobs were asked for
        eng.finish(r, "length")
      else:
        eng.emit(r, [int(tok[i])], [float(lp[i])], top_lp[i:i + 1], top_ids[i:i + 1])


def scores_prompt(r: Request) -> bool:
  """Whether `r`'s prefill runs the SCORE variant: it wants prompt logprobs and did not take them from a sample
  it shares the prompt's pages with."""
  return r.params.prompt_logprobs is not None and r.shared_prompt_tokens == 0


def share_prefills(eng) -> None:
  """Every running sample waiting on another's prefill takes that one's full prompt pages once its prompt is
  cached, and its prompt logprobs; a sample whose source is gone (finished, aborted, failed) prefills alone."""
  for r in eng.running:
    src = r.prefill_source
    if src is None or r.finished:
      continue
    if src.finished or src.request_id not in eng.allocator.owners():
      r.prefill_source = None
      continue
    if eng.prefilled(src) < len(src.prompt_ids):
      continue  # still prefilling: wait for it
    try:
      shared = eng.allocator.fork(src.request_id, r.request_id, eng.allocator.shareable_tokens(len(r.prompt_ids)))
    except Exception as e:
      eng.fail_request(r, "sharing its prompt's pages", e)
      continue
    r.prefill_source = None
    r.shared_prompt_tokens = shared
    # the sampling key of each forward is (seed, round): skip the rounds of the chunks it did not run, so its first
    # token is drawn with the key it would have had prefilling alone (a seeded sample is the same alone)
    chunk = eng.rc.prefill_chunk
    r.round_counter += -(-len(r.prompt_ids) // chunk) - -(-(len(r.prompt_ids) - shared) // chunk)
    if shared and src.prompt_logprobs is not None and r.params.prompt_logprobs is not None:
      r.prompt_logprobs = list(src.prompt_logprobs)
    eng.totals["prompt_tokens_shared"] += shared
