"""Host overhead of the engine: engine wall time per device call against the same compiled calls alone.

The model is near-zero-cost on purpose (a random 2-layer, 64-wide NLD written with the project's checkpoint code,
the bundled tokenizer beside it), so what the engine adds per step between device calls is what is measured. For
each policy and concurrency C, C requests (the same prompt length, greedy, `--max_tokens` each, EOS ignored) run to
the end; the steps where every request decodes (no prefill, nobody finished yet) are timed, and every device call
they made is recorded (`Runner.before_execute`). Each generation starts a fresh strategy (RecGuide's first
measurements of each regime are in every one). Right after every third such step its compiled calls are replayed
alone with the recorded arguments (under the same machine load), back to back, their outputs read back as the
engine reads them: the bare device time of a step (the step after a replay is not timed). Host work per step is
measured directly: the step's wall time outside the device calls and their read-backs, and the engine thread's CPU
time over the same span (on this CPU XLA's threads compete with it for the cores: the CPU time is the host work
alone); per request-step it is divided by C and by the AR steps one call runs (a 4-step decode call is 4
request-steps per request).

A cProfile of the engine's host side at the largest C (the same timed steps; `--profile_policies`) says which
functions cost what: in the engine thread's CPU time, so a read-back's wait for the device counts only the work it
does.

  python launch/bench_host.py                              # ar, linear, recguide (also pinned to adaptive B);
                                                           # C = 1, 8, 32, 128
  python launch/bench_host.py --output_dir docs            # docs/bench_host.{json,md}
"""

from __future__ import annotations

import cProfile
import io
import os
import pathlib
import pstats
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "launch")):
  if _p not in sys.path:
    sys.path.insert(0, _p)


def build_model(directory: pathlib.Path, num_layers: int = 2) -> pathlib.Path:
  """A random `num_layers`-layer, 64-wide NLD checkpoint (the bundled model's vocabulary and tokenizer), written
  once per depth."""
  directory = directory / f"layers{num_layers}"
  if (directory / "params").exists():
    return directory
  import dataclasses

  from flax import nnx

  from recguide_jax.llm import BUNDLED_CHECKPOINT
  from recguide_jax.model import checkpoint as ckpt_lib
  from recguide_jax.model.config import NLDConfig
  from recguide_jax.model.nld import NLDModel
  base = NLDConfig.from_json_file(BUNDLED_CHECKPOINT / "config.json")
  cfg = dataclasses.replace(base, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, lora_rank=8)
  ckpt_lib.save_model(directory, NLDModel(cfg, rngs=nnx.Rngs(0)))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(BUNDLED_CHECKPOINT / name, directory / name)
  return directory


class Recorder:
  """Records the device calls of the runner (`before_execute`)."""

  def __init__(self):
    self.calls: list = []

  def __call__(self, key, args):
    self.calls.append((key, args))


class Served:
  """The server's side of streamed requests, as `launch/serve.py` runs it: each request's update callback is a real
  `Tracker`'s (inter-token latency and finish metrics, its updates handed to the event loop through the loop's
  outbox), on an event loop of its own thread that reads every tracker as a streaming response does. The engine is
  stepped by the benchmark itself, so its thread's host work includes the callbacks'."""

  def __init__(self, llm):
    import asyncio
    import threading

    from recguide_jax.engine.thread import EngineThread
    from recguide_jax.server.metrics import ServerMetrics
    from recguide_jax.server.tracker import LoopOutbox
    self.loop = asyncio.new_event_loop()
    threading.Thread(target=self.loop.run_forever, name="bench-host-loop", daemon=True).start()
    self.outbox = LoopOutbox(self.loop)
    self.engine_thread = EngineThread(llm.engine)  # never started: it only gives the metrics the engine
    self.metrics = ServerMetrics(self.engine_thread, "bench_host")
    self.readers: list = []

  def callback(self, prompt: list[int], params, rid: str):
    """A tracker of a streamed request (read on the loop until it finishes); returns its `on_update`."""
    import asyncio

    from recguide_jax.server import protocol
    from recguide_jax.server.tracker import Tracker
    gen = protocol.GenerationRequest([protocol.Prompt(prompt, None)], params, stream=True)

    async def start():
      tracker = Tracker(self.outbox, self.engine_thread, rid, gen, self.metrics)
      return tracker, asyncio.ensure_future(tracker.wait_finished())
    tracker, reader = asyncio.run_coroutine_threadsafe(start(), self.loop).result()
    self.readers.append(reader)
    return tracker.on_update

  def wait(self) -> None:
    """Until every tracker read its final update."""
    import asyncio

    async def all_read(readers):
      await asyncio.gather(*readers)
    readers, self.readers = self.readers, []
    asyncio.run_coroutine_threadsafe(all_read(readers), self.loop).result(60)


# RecGuide with its regime pinned to adaptive B, deciding with fitted tables (`--recguide_tables`): the steps it runs
# at heavy load on a model whose drafts pay (this random model's do not, so the switch would run AR there)
RECGUIDE_ADAPTIVE = "recguide_adaptive"


def strategy_for(policy: str, tables_path: str | None = None):
  """The strategy a policy name of this benchmark runs: a registered policy's at B = 16, or `RECGUIDE_ADAPTIVE`'s
  with the tables at `tables_path` (None: none)."""
  from recguide_jax.decoding.registry import make_strategy
  if policy == RECGUIDE_ADAPTIVE:
    from recguide_jax.recguide.adaptive import load_tables
    from recguide_jax.recguide.config import Regime
    from recguide_jax.recguide.controller import RecGuideStrategy
    return RecGuideStrategy(16, fixed_regime=Regime.ADAPTIVE,
                            tables=load_tables(tables_path) if tables_path else None)
  return make_strategy(policy, 16)


def timed_steps(llm, policy: str, c: int, max_tokens: int, prompt_len: int, profile: bool = False, replays: int = 0,
                served: Served | None = None, tables_path: str | None = None):
  """Runs C requests to the end; returns [(step seconds, [(key, args)] of its calls, their bare seconds, host work
  seconds, dispatch seconds, host CPU seconds)] of the steps where all C decoded, and the profiles of those steps
  (one each, in the engine thread's CPU time; or None). `served`: the requests are streamed through the server's
  trackers. `tables_path`: the fitted tables of `RECGUIDE_ADAPTIVE`."""
  from recguide_jax.engine.requests import SamplingParams
  from recguide_jax.runtime.compilation import CompileCounter
  eng = llm.engine
  llm.set_policy(strategy_for(policy, tables_path))
  params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
  for i in range(c):
    prompt, rid = [5 + (i + k) % 97 for k in range(prompt_len)], f"bench-{eng.step_count}-{i}"
    eng.add_request(prompt, params, rid, None if served is None else served.callback(prompt, params, rid))
  rec = Recorder()
  llm.runner.before_execute = rec
  import jax
  profiles = [] if profile else None  # one per timed step (a step that is not timed drops its own)
  steps, skipped = [], 0
  # time inside the device calls (dispatch: the host launching them, which returns before the device is done) and
  # their read-backs: the rest of a step is the engine's host work. Also the engine thread's own CPU time outside
  # them: XLA computes on its own threads, so this is the host work without their competing for the cores
  inside, dispatch, inside_cpu = [0.0], [0.0], [0.0]
  execute, device_get = llm.runner.execute, jax.device_get

  def timed(fn, *counters):
    def call(*args, **kwargs):
      t, cpu = time.perf_counter(), time.thread_time()
      try:
        return fn(*args, **kwargs)
      finally:
        for counter in counters:
          counter[0] += time.perf_counter() - t
        inside_cpu[0] += time.thread_time() - cpu
    return call
  llm.runner.execute, jax.device_get = timed(execute, inside, dispatch), timed(device_get, inside)
  try:
    while eng.has_work():
      full = (not eng.waiting and len(eng.running) == c
              and all(r.seed_token is not None and eng.prefilled(r) == len(r.prompt_ids) for r in eng.running))
      rec.calls = []
      prof = cProfile.Profile(time.thread_time) if profile and full else None
      if prof is not None:
        prof.enable()
      inside[0] = dispatch[0] = inside_cpu[0] = 0.0
      compiles = CompileCounter.total()
      t0, cpu0 = time.perf_counter(), time.thread_time()
      eng.step()
      dt, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
      compiled = CompileCounter.total() > compiles
      device, launching, host_cpu = inside[0], dispatch[0], cpu - inside_cpu[0]
      if prof is not None:
        prof.disable()
      # a step where every request decoded and none finished: the steady state. Every third one's calls are replayed
      # right after it, under the same machine load (a replay rewrites the same K/V from the same inputs: harmless);
      # the step after a replay is not timed (a call the engine dispatched ahead ran meanwhile)
      # (a step that compiled a variant a strategy first used in this generation is not timed either)
      if full and all(not r.finished for r in eng.running) and rec.calls and not compiled:
        calls, rec.calls = rec.calls, []
        k = len(steps) + skipped
        if k % 3 == 2:
          skipped += 1
          continue
        bare = None
        if replays and k % 3 == 1:
          jax.block_until_ready(llm.runner.cache)  # the engine's call in flight, if any, first
          bare = bare_seconds(llm.runner, calls, replays)
        steps.append((dt, calls, bare, dt - device, launching, host_cpu))
        if prof is not None:
          profiles.append(prof)
  finally:
    llm.runner.before_execute = None
    llm.runner.execute, jax.device_get = execute, device_get
  if served is not None:
    served.wait()
  assert eng.allocator.num_used == 0
  return steps, profiles


def bare_seconds(runner, calls, repeats: int) -> float:
  """The step's device calls replayed alone (back to back, outputs read back once at the end as the engine reads
  them): median wall seconds."""
  import jax
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    outs = [runner.execute(key, args) for key, args in calls]
    jax.device_get(outs)
    out.append(time.perf_counter() - t0)
  return statistics.median(out)


def measure(llm, policy: str, c: int, cfg, served: Served | None = None) -> dict:
  timed_steps(llm, policy, c, cfg["max_tokens"], cfg["prompt_len"], tables_path=cfg["recguide_tables"])  # compiles
  from recguide_jax.engine.gc_heap import GCPauses
  walls, bares, hosts, host_cpus, dispatches, calls_per_step, steps_per_call = [], [], [], [], [], [], []
  engine_steps = llm.engine.step_count
  with GCPauses() as pauses:
    runs = [timed_steps(llm, policy, c, cfg["max_tokens"], cfg["prompt_len"], replays=3, served=served,
                        tables_path=cfg["recguide_tables"])[0]
            for _ in range(cfg["repeats"])]
  engine_steps = llm.engine.step_count - engine_steps
  for steps in runs:
    for dt, calls, bare, host, launching, host_cpu in steps:
      walls.append(dt)
      hosts.append(host)
      host_cpus.append(host_cpu)
      dispatches.append(launching / len(calls))
      if bare is not None:
        bares.append(bare)
      calls_per_step.append(len(calls))
      steps_per_call.append(max(k.steps for k, _ in calls))
  if not walls:
    return {"policy": policy, "concurrency": c, "served": served is not None, "steps": 0}
  # medians, and minima: on a shared machine a step's minimum over many is the better estimate of its own cost
  out = {"policy": policy, "concurrency": c, "served": served is not None, "steps": len(walls),
         "bare_samples": len(bares),
         "calls_per_step": statistics.median(calls_per_step), "ar_steps_per_call": statistics.median(steps_per_call),
         # Python's collector over the whole generations (every engine step, timed or not)
         "gc_runs_by_generation": pauses.runs, "gc_ms_per_engine_step": sum(pauses.seconds) * 1e3 / engine_steps,
         "gc_longest_pause_ms": pauses.longest * 1e3}
  for stat, fn in (("", statistics.median), ("_min", min)):
    wall, bare = fn(walls), fn(bares)
    out.update({f"engine_step_ms{stat}": wall * 1e3, f"bare_step_ms{stat}": bare * 1e3,
                f"engine_per_call_ms{stat}": wall * 1e3 / out["calls_per_step"],
                f"bare_per_call_ms{stat}": bare * 1e3 / out["calls_per_step"],
                f"engine_vs_bare{stat}": wall / bare, f"host_per_step_ms{stat}": (wall - bare) * 1e3,
                f"host_per_request_step_us{stat}": (wall - bare) * 1e6 / (c * out["ar_steps_per_call"]),
                f"host_work_per_step_ms{stat}": fn(hosts) * 1e3,
                f"host_cpu_per_step_ms{stat}": fn(host_cpus) * 1e3,
                f"host_cpu_per_request_step_us{stat}": fn(host_cpus) * 1e6 / (c * out["ar_steps_per_call"]),
                f"dispatch_per_call_ms{stat}": fn(dispatches) * 1e3,
                f"host_work_per_request_step_us{stat}": fn(hosts) * 1e6 / (c * out["ar_steps_per_call"])})
  # a pipelined engine's steps alternate (one waits for the device, the next finds its call done): the mean over
  # the steady window is its rate
  out["engine_per_call_ms_mean"] = statistics.mean(walls) * 1e3 / out["calls_per_step"]
  out["bare_per_call_ms_mean"] = statistics.mean(bares) * 1e3 / out["calls_per_step"]
  out["engine_vs_bare_mean"] = statistics.mean(walls) / statistics.mean(bares)
  return out


def profile_top(llm, policy: str, c: int, cfg, top: int = 25) -> str:
  timed_steps(llm, policy, c, cfg["max_tokens"], cfg["prompt_len"], tables_path=cfg["recguide_tables"])
  steps, profiles = timed_steps(llm, policy, c, cfg["max_tokens"], cfg["prompt_len"], profile=True,
                                tables_path=cfg["recguide_tables"])
  head = f"{policy} C={c}, {len(steps)} timed steps (engine-thread CPU seconds; tottime: the function's own)"
  if not profiles:
    return head
  s = io.StringIO()
  pstats.Stats(*profiles, stream=s).sort_stats("tottime").print_stats(top)
  lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
  start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
  return "\n".join([head] + [ln.replace(ROOT + "/", "") for ln in lines[start:start + top + 1]])


def label(point: dict) -> str:
  return point["policy"] + (" (served)" if point.get("served") else "")


def markdown(result: dict) -> str:
  meta = result["meta"]
  lines = ["# Host overhead per device call", "",
           f"Near-zero-cost model (random NLD, {meta['model']}); C requests of {meta['prompt_len']} prompt tokens, "
           f"{meta['max_tokens']} new tokens each, greedy; AR decode calls of {meta['decode_steps']} steps; the "
           "steps where all C requests decode (and none compiles a variant) are timed, every third followed by its "
           "device calls replayed alone. Medians over "
           f"{meta['repeats']} generations. jax {meta['jax']} ({meta['backend']}, {meta['cpu_count']} cores), load "
           f"average {meta['load_start']:.1f} at the start, {meta['load_end']:.1f} at the end ({meta['time_utc']}, "
           f"code {meta['code']}). On this shared CPU absolute numbers are upper bounds."
           + (" Ragged steps (`--bucketing=ragged`)." if meta.get("bucketing") == "ragged" else ""), "",
           "Each cell: median / minimum over the timed steps (engine, host work) and the replays (bare). A step is "
           "one engine iteration: one AR call, one LinearSS round (draft + verify), or RecGuide's round(s).", "",
           "Host work: a step's wall time outside the device calls and their read-backs (the engine's own Python, "
           "measured directly; with the pipeline it runs while the device computes). Host CPU: the engine "
           "thread's CPU time over the same span (XLA computes on its own threads: this is the host work without "
           "them competing for this machine's cores, as an accelerator's would not). Dispatch: the host time a "
           "device call takes to launch (its arguments flattened and handed over; counted inside the device calls "
           "above, not in host work). Engine / bare: mean engine wall "
           "per call over the steady window against the mean bare call (a pipelined engine's single steps alternate "
           "between waiting and not). GC: Python's collector over the whole generations, per engine step (its "
           f"longest pause); the start-up heap {'frozen' if meta.get('freeze_gc') else 'not frozen'} "
           "(`launch/serve.py` freezes it).", "",
           "(served): the same requests streamed through the server's trackers, as `launch/serve.py` runs them: "
           "each request's update callback records its inter-token latency and hands its tokens to an event loop "
           "(on its own thread, reading every stream), so the engine thread's host work includes what serving adds "
           "per request and step.", "",
           f"{RECGUIDE_ADAPTIVE}: RecGuide with its regime pinned to adaptive B (every step a LinearSS step whose "
           "blocks the rule and the batch pricing choose), deciding with "
           + (f"the fitted tables `{os.path.relpath(meta['recguide_tables'], ROOT)}` (per-request signals, values "
              "and their online calibration)" if meta.get("recguide_tables") else "no tables (online estimates)")
           + ": the steps RecGuide runs at heavy load on a model whose drafts pay.", "",
           "| policy | C | steps | host work per step (ms) | host work per request-step (us) | "
           "host CPU per step (ms) | host CPU per request-step (us) | "
           "dispatch per call (ms) | engine per call (ms) | bare call (ms) | engine / bare (mean) | "
           "GC per step (ms; longest pause) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for p in result["points"]:
    if not p.get("steps"):
      lines.append(f"| {label(p)} | {p['concurrency']} | 0 | | | | | | | | | |")
      continue

    def cell(key, fmt):
      return f"{p[key]:{fmt}} / {p[key + '_min']:{fmt}}"
    lines.append(f"| {label(p)} | {p['concurrency']} | {p['steps']} | {cell('host_work_per_step_ms', '.3f')} | "
                 f"{cell('host_work_per_request_step_us', '.1f')} | {cell('host_cpu_per_step_ms', '.3f')} | "
                 f"{cell('host_cpu_per_request_step_us', '.1f')} | {cell('dispatch_per_call_ms', '.3f')} | "
                 f"{cell('engine_per_call_ms', '.3f')} | "
                 f"{cell('bare_per_call_ms', '.3f')} | {p['engine_vs_bare_mean']:.2f} | "
                 f"{p['gc_ms_per_engine_step']:.3f} ({p['gc_longest_pause_ms']:.1f}) |")
  for prof in result.get("profiles", []):
    lines += ["", "```", prof, "```"]
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  from absl import flags

  import jax

  from bench_peer import code_version, quiet_logging

  from recguide_jax.benchmarks import cli
  from recguide_jax.benchmarks.report import write_report
  from recguide_jax.llm import LLM
  f = flags.FLAGS
  quiet_logging()
  model = build_model(pathlib.Path(f.model_dir), f.num_layers)
  cfg = {"max_tokens": f.max_tokens, "prompt_len": f.prompt_len, "repeats": f.repeats,
         "recguide_tables": f.recguide_tables or None}
  concurrency = cli.int_list("concurrency")
  llm = LLM(str(model), policy="recguide", max_num_seqs=max(concurrency), max_model_len=256, page_size=16,
            prefill_chunk=32, warmup=False, decode_steps=f.decode_steps, layer_loop=f.layer_loop,
            bucketing=f.bucketing)
  if hasattr(llm.engine, "pipeline"):
    llm.engine.pipeline = f.pipeline
  if f.freeze_gc:
    from recguide_jax.engine.gc_heap import freeze_startup_heap
    freeze_startup_heap()
  load_start = os.getloadavg()[0]
  points = []
  served = Served(llm) if f.served_policies else None
  for policy, how in [(p, None) for p in f.policies] + [(p, served) for p in f.served_policies]:
    for c in concurrency:
      p = measure(llm, policy, c, cfg, how)
      points.append(p)
      print(p, flush=True)
  profiles = [profile_top(llm, policy, max(concurrency), cfg) for policy in f.profile_policies if policy]
  arrays = len(jax.tree.leaves(llm.runner.state))
  meta = {"model": f"{f.num_layers} layers ({llm.runner.layer_loop.value}, {arrays} weight arrays), hidden 64, "
                   "vocab 2048", "prompt_len": f.prompt_len, "max_tokens": f.max_tokens,
          "decode_steps": f.decode_steps, "repeats": f.repeats, "jax": jax.__version__,
          "backend": jax.default_backend(), "cpu_count": os.cpu_count(), "load_start": load_start,
          "load_end": os.getloadavg()[0], "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
          "code": code_version(), "freeze_gc": f.freeze_gc, "recguide_tables": cfg["recguide_tables"],
          "bucketing": f.bucketing}
  result = {"meta": meta, "points": points, "profiles": profiles}
  js, md = write_report(result, markdown(result), cli.output_dir(), "bench_host")
  print(markdown(result))
  print(f"wrote {js} and {md}")


def _define_flags():
  from absl import flags

  from recguide_jax.benchmarks import cli
  flags.DEFINE_list("policies", ["ar", "linear", "recguide", RECGUIDE_ADAPTIVE], "Policies to measure (linear: "
                    f"LinearSS at B = 16; {RECGUIDE_ADAPTIVE}: RecGuide with its regime pinned to adaptive B, the "
                    "steps it runs at heavy load where drafts pay).")
  flags.DEFINE_list("concurrency", ["1", "8", "32", "128"], "Requests decoded together (C).")
  flags.DEFINE_integer("max_tokens", 96, "New tokens per request.")
  flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per request.")
  flags.DEFINE_integer("repeats", 2, "Timed generations per point (after one that compiles).")
  flags.DEFINE_integer("decode_steps", 4, "AR decode steps per device call.")
  flags.DEFINE_bool("pipeline", True, "Run AR and LinearSS calls ahead (Engine.pipeline).")
  flags.DEFINE_enum("bucketing", "auto", ["auto", "ragged"], "How a step's rows at different blocks run (LLM's "
                    "bucketing; launch/serve.py --bucketing): ragged runs them as one ragged step.")
  flags.DEFINE_bool("freeze_gc", True, "Freeze the start-up heap out of Python's collector, as launch/serve.py "
                    "does.")
  flags.DEFINE_list("served_policies", ["ar", "linear", "recguide"], "Policies measured again with every request "
                    "streamed through the server's trackers (`Served`): the engine thread's host work as "
                    "launch/serve.py runs it.")
  flags.DEFINE_list("profile_policies", ["ar", "linear", "recguide", RECGUIDE_ADAPTIVE],
                    "Policies profiled at the largest C.")
  flags.DEFINE_string("recguide_tables", os.path.join(ROOT, "checkpoints", "nld-tiny-gsm8k", "recguide_tables.json"),
                      f"Fitted tables {RECGUIDE_ADAPTIVE} decides with (its per-request values, signals and value "
                      "calibration are the host work a checkpoint with tables adds; empty: none).")
  flags.DEFINE_string("model_dir", os.path.join(ROOT, "runs", "bench_host", "model"),
                      "Where the random models are written (once per depth).")
  flags.DEFINE_integer("num_layers", 2, "Decoder layers of the random model: a deep model's many weight arrays "
                       "show in each call's dispatch (NLD-8B has 32).")
  flags.DEFINE_enum("layer_loop", "auto", ["auto", "scan", "unrolled"], "How the forward runs the layers (LLM's "
                    "layer_loop; unrolled, one weight array per layer and kernel, is what a GPU runs).")
  cli.define_output_flags("bench_host")


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli as _cli
  _define_flags()
  _cli.run(main)
