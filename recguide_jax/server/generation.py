"""Serving one generation request (completions or chat): its n samples submitted to the engine thread (sample i with
seed `seed + i`, every sample after the first sharing the first one's prefill), then one JSON answer with a choice
per sample, or one SSE stream whose chunks carry their choice's `index`. With `echo` each completion choice starts
with the prompt, and with logprobs the prompt's logprobs (scored while it was prefilled), as OpenAI and vLLM send
them: what lm-eval's loglikelihood tasks read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from recguide_jax.engine.thread import EngineThread
from recguide_jax.engine.requests import RequestError, best_samples
from recguide_jax.server import protocol, responses
from recguide_jax.server.metrics import ServerMetrics
from recguide_jax.server.streaming import TextDeltas
from recguide_jax.server.tracker import EventStream, Final, LoopOutbox, Tracker, disconnected
from recguide_jax.text.tokenizer import Tokenizer

log = logging.getLogger("recguide_jax.server")


def failure(final: Final) -> protocol.APIError | None:
  """The error answer of a request that ended in an error or was aborted, else None."""
  if final.finish_reason == "error":
    status = final.error_code or 500
    return protocol.APIError(status, final.error or "engine error", None, "engine_error" if status >= 500 else None)
  if final.finish_reason == "abort":
    return protocol.APIError(503, "the request was aborted", None, "request_aborted")
  return None


@dataclasses.dataclass
class Generation:
  """The generation routes' shared state: the engine thread, the tokenizer, the served name, the metrics, and the
  engine ids in flight (a client's X-Request-Id reused while it runs gets a suffix), and the loop's outbox the
  engine thread hands their updates to."""
  engine_thread: EngineThread
  tokenizer: Tokenizer
  model_name: str
  metrics: ServerMetrics
  live_ids: set = dataclasses.field(default_factory=set)
  _outbox: LoopOutbox | None = dataclasses.field(default=None, init=False, repr=False)

  def outbox(self) -> LoopOutbox:
    """The running event loop's outbox (every tracker of the loop shares it)."""
    loop = asyncio.get_running_loop()
    if self._outbox is None or self._outbox.loop is not loop:
      self._outbox = LoopOutbox(loop)
    return self._outbox

  # ---- submission ------------------------------------------------------------------------------------------------
  def submit(self, request: Request, gen: protocol.GenerationRequest, prefix: str, index: int | None = None,
             prefill_source: str | None = None) -> Tracker:
    rid = f"{prefix}-{request.state.request_id}" + (f"-{index}" if index is not None else "")
    if rid in self.live_ids:  # the engine keys pages by id: two running requests must not share one
      rid = f"{rid}-{uuid.uuid4().hex[:8]}"
    tracker = Tracker(self.outbox(), self.engine_thread, rid, gen, self.metrics, self.live_ids)
    self.live_ids.add(rid)
    try:
      self.engine_thread.submit(gen.prompt_ids, gen.params, rid, tracker.on_update, prefill_source=prefill_source)
    except RequestError as e:  # includes QueueFull (429) and prompt too long (413)
      self.live_ids.discard(rid)
      err = protocol.APIError.from_request_error(e)
      if gen.chat and err.param == "prompt":
        err.param = "messages"  # a chat request's prompt is its rendered messages
      raise err from None
    return tracker

  def submit_samples(self, request: Request, gen: protocol.GenerationRequest, prefix: str,
                     first_index: int | None = None) -> list[Tracker]:
    """One engine request per sample (n, or best_of) of the request's (single) prompt: sample i with its own seed
    (`SamplingParams.sample`), each after the first sharing the first one's prefill (the prompt is computed
    once). `first_index`: the id suffix of sample 0 (a batch of prompts numbers its samples on)."""
    count = gen.params.num_samples
    if count == 1 and first_index is None:
      return [self.submit(request, gen, prefix)]
    trackers: list[Tracker] = []
    try:
      for i in range(count):
        sample = dataclasses.replace(gen, params=gen.params.sample(i))
        trackers.append(self.submit(request, sample, prefix, index=(first_index or 0) + i,
                                    prefill_source=trackers[0].rid if trackers else None))
    except BaseException:
      for tracker in trackers:
        tracker.close()
      raise
    return trackers

  def submit_prompts(self, request: Request, gen: protocol.GenerationRequest, prefix: str) -> list[list[Tracker]]:
    """Every prompt's samples, one list per prompt. Every prompt is checked before any is submitted, so a bad one
    in a batch queues nothing; a later failure (a full queue) aborts the ones already queued."""
    many = len(gen.prompts) > 1
    if many or gen.params.num_samples > 1:
      for i, p in enumerate(gen.prompts):
        try:  # n and best_of against the policy (each sample alone is one plain request), every prompt in range
          self.engine_thread.engine.validate_request(p.ids, gen.params)
        except RequestError as e:
          err = protocol.APIError.from_request_error(e)
          if many and err.param == "prompt":
            err = protocol.APIError(err.status, f"prompt[{i}]: {err.message}", err.param, err.code)
          raise err from None
    count = gen.params.num_samples
    groups: list[list[Tracker]] = []
    try:
      for i in range(len(gen.prompts)):
        groups.append(self.submit_samples(request, gen.for_prompt(i), prefix,
                                          first_index=i * count if many else None))
    except BaseException:
      for group in groups:
        for tracker in group:
          tracker.close()
      raise
    return groups

  # ---- answer pieces ---------------------------------------------------------------------------------------------
  def logprobs_payload(self, gen: protocol.GenerationRequest, entries, offset: int):
    """(payload or None, new text offset) for a run of logprob entries."""
    if gen.params.logprobs is None:
      return None, offset
    if gen.chat:
      return responses.chat_logprobs(self.tokenizer, entries, gen.tokens_as_ids), offset
    return responses.completion_logprobs(self.tokenizer, entries, offset, gen.tokens_as_ids)

  def echo_prefix(self, gen: protocol.GenerationRequest, prompt_logprobs) -> tuple[str, dict | None, int]:
    """(text, logprobs payload or None, text offset after it) an echoed choice starts with."""
    text = gen.prompt_text if gen.prompt_text is not None else self.tokenizer.decode(gen.prompt_ids)
    if gen.params.logprobs is None:
      return text, None, 0
    payload, offset = responses.echoed_prompt_logprobs(self.tokenizer, gen.prompt_ids, prompt_logprobs or [None],
                                                       gen.tokens_as_ids)
    return text, payload, offset

  # ---- answers ---------------------------------------------------------------------------------------------------
  async def serve(self, request: Request, gen: protocol.GenerationRequest, prefix: str):
    created = int(time.time())
    if gen.ignored_fields:
      log.warning("%s-%s: the following fields were present in the request but ignored: %s", prefix,
                  request.state.request_id, ", ".join(gen.ignored_fields))
    groups = self.submit_prompts(request, gen, prefix)
    trackers = [t for group in groups for t in group]
    rid = trackers[0].rid if len(trackers) == 1 else f"{prefix}-{request.state.request_id}"
    if gen.stream:
      return EventStream(self.stream(gen, trackers, created, rid), trackers)
    return await self.complete(request, gen, groups, created, rid)

  async def complete(self, request: Request, gen: protocol.GenerationRequest, groups: list[list[Tracker]],
                     created: int, rid: str):
    """The non-streamed answer: choice p * n + j is sample j of prompt p (n > 1: independent samples of it)."""
    trackers = [t for group in groups for t in group]
    waiter = asyncio.ensure_future(asyncio.gather(*(t.wait_finished() for t in trackers)))
    gone = asyncio.ensure_future(disconnected(request))
    try:
      await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
      gone.cancel()
      if not waiter.done():
        waiter.cancel()
      for tracker in trackers:
        tracker.close()  # the client left (or we were cancelled) before the end: free the request's pages
    if waiter.cancelled() or not waiter.done():
      return Response(status_code=499)  # nobody is listening; uvicorn drops it
    finals = waiter.result()
    for final in finals:
      err = failure(final)
      if err is not None:
        raise err
    chosen: list[tuple[int, Final]] = []  # (prompt, final) in choice order
    at = 0
    for p, group in enumerate(groups):
      mine = finals[at:at + len(group)]
      at += len(group)
      if len(mine) > gen.n:  # best_of
        mine = best_samples(mine, gen.n)
      chosen += [(p, f) for f in mine]
    use = responses.usage(sum(len(p.ids) for p in gen.prompts), sum(len(f.output_ids) for _, f in chosen))
    build = responses.chat if gen.chat else responses.completion
    choices = []
    for index, (p, final) in enumerate(chosen):
      text, prompt_payload, offset = final.text, None, 0
      if gen.echo:
        shared = next((f.prompt_logprobs for q, f in chosen if q == p and f.prompt_logprobs is not None), None)
        prompt_text, prompt_payload, offset = self.echo_prefix(gen.for_prompt(p), final.prompt_logprobs or shared)
        text = prompt_text + text
      lps, _ = self.logprobs_payload(gen, final.logprobs or [], offset)
      if gen.echo:
        lps = responses.join_logprobs(prompt_payload, lps)
      body = build(rid, created, self.model_name, text, final.finish_reason, lps, use, final.stats,
                   stop_reason=final.stop_reason)
      choices.append({**body["choices"][0], "index": index})
    if len(choices) > 1:  # each choice keeps its own speculation stats; the top level has the first's
      for choice, (_, final) in zip(choices, chosen):
        choice["speculation"] = final.stats
    body["choices"] = choices
    body["speculation"] = chosen[0][1].stats
    return JSONResponse(body)

  async def stream(self, gen: protocol.GenerationRequest, trackers: list[Tracker], created: int, rid: str):
    """The SSE answer: the choices' chunks interleaved as their tokens arrive, each with its `index` (tracker i is
    choice i: sample j of prompt p is p * n + j); then, with include_usage, one usage chunk for all of them."""
    chat, n = gen.chat, len(trackers)
    deltas = [TextDeltas.for_params(self.tokenizer, gen.params) for _ in trackers]
    lp_sent, offsets, started = [0] * n, [0] * n, [False] * n
    finals: list[Final | None] = [None] * n
    prompt_tokens = sum(len(p.ids) for p in gen.prompts)

    def completion_tokens() -> int:
      return sum(len(f.output_ids) if f is not None else len(t.emitted) for t, f in zip(trackers, finals))

    def chunk(i, text, **kw):
      so_far = responses.usage(prompt_tokens, completion_tokens()) if gen.continuous_usage else None
      return responses.chunk(chat, rid, created, self.model_name, text, include_usage=gen.include_usage,
                             usage_so_far=so_far, index=i, **kw)

    pending: dict[asyncio.Future, int] = {}
    try:
      if chat:
        for i in range(n):
          yield responses.sse(chunk(i, "", role=True))
      for i, tracker in enumerate(trackers):
        pending[asyncio.ensure_future(tracker.next())] = i
      error = None
      while pending and error is None:
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for fut in sorted(done, key=pending.get):
          i = pending.pop(fut)
          tracker = trackers[i]
          _, lps, final = fut.result()
          error = failure(final) if final is not None else None
          if error is not None:
            break
          if gen.echo and not started[i]:
            prompt_text, payload, offsets[i] = self.echo_prefix(tracker.gen, tracker.prompt_logprobs)
            yield responses.sse(chunk(i, prompt_text, logprobs=payload))
          started[i] = True
          if final is None:
            text = deltas[i].update(tracker.emitted)
            payload, offsets[i] = self.logprobs_payload(gen, lps, offsets[i]) if lps else (None, offsets[i])
            lp_sent[i] += len(lps)
            if text or lps:
              yield responses.sse(chunk(i, text, logprobs=payload))
            pending[asyncio.ensure_future(tracker.next())] = i
            continue
          finals[i] = final
          text = deltas[i].finish(final.text)
          payload, offsets[i] = self.logprobs_payload(gen, (final.logprobs or [])[lp_sent[i]:], offsets[i])
          last = chunk(i, text, finish_reason=final.finish_reason, stop_reason=final.stop_reason, logprobs=payload)
          last["speculation"] = final.stats
          yield responses.sse(last)
      if error is not None:
        self.metrics.record_error(error.status)
        yield responses.sse(error.body())
      elif gen.include_usage:
        use = responses.usage(prompt_tokens, completion_tokens())
        yield responses.sse(responses.usage_chunk(chat, rid, created, self.model_name, use, finals[0].stats))
      yield responses.SSE_DONE
    except Exception as e:  # a bug here must still end the stream in a way clients understand
      log.exception("stream %s failed", rid)
      self.metrics.record_error(500)
      yield responses.sse(protocol.APIError(500, f"internal server error: {type(e).__name__}: {e}").body())
      yield responses.SSE_DONE
    finally:
      for fut in pending:
        fut.cancel()
      for tracker in trackers:
        tracker.close()
