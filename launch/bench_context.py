"""Decode step time vs `max_model_len` at a fixed live context: does a step cost what the context needs, or what
the engine was sized for?

For every `--max_model_lens` value an engine is built (`LLM(..., max_model_len=M)`, same checkpoint, same KV page
size), `C` requests with prompts of exactly `--context` tokens run greedy, and the engine's own per-round wall times
are recorded: the engine hands every decode round's wall time (batch assembly, the forward(s), acceptance,
emission) to its policy (`Strategy.observe`), and a thin subclass of the fixed policies keeps them. A round is
one AR step (a call of `--decode_steps` AR steps, reported per step) or one LinearSS round (one draft + one verify
of a block of B). Each point
first runs one untimed generation (compiles), then `--repeats` timed ones; the median over the first `--rounds`
decode rounds of every timed generation is reported, so every point is measured at the same live contexts
(`--context` tokens plus what those rounds add). A step whose attention follows the live context is flat across a
row of the table; one that reads every page of `max_model_len` grows with it.

  python launch/bench_context.py                      # bundled model, M = 1k/4k/16k, C = 1 and 8, AR + LinearSS-16
  python launch/bench_context.py --output_dir docs    # docs/bench_context.{json,md}
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "launch")):
  if _p not in sys.path:
    sys.path.insert(0, _p)

POLICIES = ("ar", "linear")


@dataclasses.dataclass(frozen=True)
class ContextConfig:
  checkpoint: str | None = None  # None: the bundled model
  max_model_lens: tuple[int, ...] = (1024, 4096, 16384)
  concurrency: tuple[int, ...] = (1, 8)
  context: int = 300  # prompt tokens per request
  policies: tuple[str, ...] = POLICIES
  block_size: int = 16
  rounds: int = 8  # decode rounds timed per generation
  repeats: int = 3  # timed generations per point
  page_size: int = 16
  prompt_source: str = "auto"  # "auto": GSM8K text when the checkpoint has a tokenizer, else random ids
  data: str | None = None
  attention: str = "auto"
  # AR decode steps per device call (LLM's decode_steps, its default); a multi-step call is one timed round, whose
  # time the engine reports per step
  decode_steps: int = 4
  seed: int = 0

  def validate(self) -> "ContextConfig":
    for name in ("max_model_lens", "concurrency"):
      vals = getattr(self, name)
      if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"--{name} must be positive integers, got {list(vals)}")
    for name in ("context", "rounds", "repeats", "page_size", "decode_steps"):
      if getattr(self, name) <= 0:
        raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
    bad = [p for p in self.policies if p not in POLICIES]
    if not self.policies or bad:
      raise ValueError(f"--policies must be a subset of {list(POLICIES)}, got {list(self.policies)}")
    if self.block_size not in (8, 16, 32):
      raise ValueError(f"--block_size must be 8, 16 or 32, got {self.block_size}")
    need = self.context + self.max_new_tokens()
    if min(self.max_model_lens) < need:
      raise ValueError(f"--max_model_lens {min(self.max_model_lens)} cannot hold --context {self.context} + the "
                       f"{self.max_new_tokens()} tokens the timed rounds may generate ({need})")
    if self.prompt_source not in ("auto", "random", "gsm8k"):
      raise ValueError(f"--prompt_source must be auto, random or gsm8k, got {self.prompt_source!r}")
    return self

  def max_new_tokens(self) -> int:
    """Enough tokens that no request ends before the last timed round, whatever the drafts accept (an AR round is a
    call of `decode_steps` steps)."""
    per_round = max(self.block_size if "linear" in self.policies else 1, self.decode_steps)
    return self.rounds * per_round + 1

  def tokens_per_round(self, name: str) -> int | None:
    """Tokens a round commits: an AR call's steps; None for LinearSS (what its verify accepts)."""
    return self.decode_steps if name == "ar" else None


def _timed_policy(name: str, block_size: int):
  """A fixed policy that also keeps the per-round wall times the engine reports to it."""
  from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
  base = ARStrategy if name == "ar" else LinearStrategy

  class Timed(base):

    def __init__(self):
      super().__init__(*(() if name == "ar" else (block_size,)))
      self.rounds: list[tuple[str, int, float]] = []

    def observe(self, outcome):
      super().observe(outcome)
      out = outcome.output
      self.rounds.append((out.label, outcome.batch.n, outcome.seconds / out.rounds))

  return Timed()


def _label(name: str, block_size: int) -> str:
  return f"linear B={block_size}" if name == "linear" else "ar"


def measure_point(llm, name: str, cfg: ContextConfig, prompts: list) -> dict:
  """One (max_model_len, policy, C) point: a warm-up generation, then `repeats` timed ones."""
  from recguide_jax import SamplingParams
  params = SamplingParams(max_tokens=cfg.max_new_tokens(), temperature=0.0, ignore_eos=True)
  samples, contexts = [], []
  for rep in range(cfg.repeats + 1):
    policy = _timed_policy(name, cfg.block_size)
    llm.set_policy(policy)
    outs = llm.generate(prompts, params)
    timed = policy.rounds[:cfg.rounds]
    if len(timed) < cfg.rounds or any(rows != len(prompts) for _, rows, _ in timed):
      raise RuntimeError(f"expected {cfg.rounds} decode rounds of {len(prompts)} rows, got "
                         f"{[(k, r) for k, r, _ in timed]}")
    if rep == 0:
      continue  # compiles
    samples += [s for _, _, s in timed]
    # cached tokens at the last timed round: the prompt plus what the earlier rounds committed (the first round
    # runs over the prompt alone; the stats list every step of a multi-step AR call as a round of 1)
    per_round = cfg.tokens_per_round(name)
    for o in outs:
      accepted = o.metrics["accepted_lengths"]
      contexts.append(cfg.context + (per_round * (cfg.rounds - 1) if per_round else sum(accepted[:cfg.rounds - 1])))
  ms = [s * 1e3 for s in samples]
  return {"policy": _label(name, cfg.block_size), "concurrency": len(prompts), "round_ms": statistics.median(ms),
          "round_ms_min": min(ms), "round_ms_all": ms, "rounds": len(ms),
          "context_at_last_round_max": max(contexts), "context_first_round": cfg.context}


def run_context(cfg: ContextConfig, log=print) -> dict:
  cfg.validate()
  import jax

  from bench_peer import code_version, make_prompts
  from recguide_jax import LLM
  from recguide_jax.llm import default_checkpoint
  ckpt = pathlib.Path(cfg.checkpoint) if cfg.checkpoint else default_checkpoint()
  load_start = os.getloadavg()
  points = []
  for max_len in cfg.max_model_lens:
    t0 = time.perf_counter()
    llm = LLM(ckpt, policy="ar", block_sizes=(cfg.block_size,), max_num_seqs=max(cfg.concurrency),
              max_model_len=max_len, page_size=cfg.page_size, warmup=False, attention=cfg.attention,
              decode_steps=cfg.decode_steps)
    load_s = time.perf_counter() - t0
    use_gsm8k = cfg.prompt_source == "gsm8k" or (cfg.prompt_source == "auto" and llm.tokenizer is not None)
    for name in cfg.policies:
      for c in cfg.concurrency:
        prompts = make_prompts(c, cfg.context, llm.cfg.vocab_size, cfg.seed, llm.tokenizer if use_gsm8k else None,
                               cfg.data)
        point = measure_point(llm, name, cfg, prompts)
        point.update(max_model_len=max_len, engine_load_s=load_s)
        points.append(point)
        log(f"max_model_len {max_len:>6}  {point['policy']:<12} C={c:<2}  {point['round_ms']:8.2f} ms/round "
            f"(min {point['round_ms_min']:.2f}, contexts {point['context_first_round']}.."
            f"{point['context_at_last_round_max']})")
    del llm
  base = min(cfg.max_model_lens)
  by = {(p["policy"], p["concurrency"], p["max_model_len"]): p for p in points}
  for p in points:
    ref = by[(p["policy"], p["concurrency"], base)]
    p["vs_smallest_max_model_len"] = p["round_ms"] / ref["round_ms"]
    p["min_vs_smallest_max_model_len"] = p["round_ms_min"] / ref["round_ms_min"]
  meta = {"checkpoint": str(ckpt), "max_model_lens": list(cfg.max_model_lens), "concurrency": list(cfg.concurrency),
          "context": cfg.context, "block_size": cfg.block_size, "rounds": cfg.rounds, "repeats": cfg.repeats,
          "page_size": cfg.page_size, "decode_steps": cfg.decode_steps,
          "prompt_source": "gsm8k" if use_gsm8k else "random",
          "timing": "engine round wall time as reported to Strategy.observe (host + device), median over the "
                    "first `rounds` decode rounds of each timed generation",
          "jax": jax.__version__, "jax_backend": jax.default_backend(), "cpu_count": os.cpu_count(),
          "load_average_start": list(load_start), "load_average_end": list(os.getloadavg()),
          "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "code": code_version()}
  return {"meta": meta, "points": points}


def markdown(result: dict) -> str:
  meta = result["meta"]
  cols = sorted({(p["policy"], p["concurrency"]) for p in result["points"]}, key=lambda x: (x[0] != "ar", x))
  by = {(p["policy"], p["concurrency"], p["max_model_len"]): p for p in result["points"]}
  lines = [
      "# Decode step time vs max_model_len", "",
      f"Checkpoint `{meta['checkpoint']}`, {meta['prompt_source']} prompts of {meta['context']} tokens, greedy, "
      f"KV page {meta['page_size']}; {meta['timing']} ({meta['rounds']} rounds x {meta['repeats']} generations per "
      f"point, after one warm-up generation). jax {meta['jax']} ({meta['jax_backend']}, {meta['cpu_count']} cores); "
      f"load average {meta['load_average_start'][0]:.1f} at the start, {meta['load_average_end'][0]:.1f} at the end "
      f"({meta['time_utc']}, code {meta['code']}).", "",
      f"ms per round (one AR step: a call of {meta.get('decode_steps', 1)} steps, its time per step; or one LinearSS "
      "draft + verify): median / minimum over the timed rounds (on a "
      "busy machine the minimum is the better estimate of the step's own cost), and in brackets their ratios to "
      "the smallest max_model_len. Flat columns: the step costs what the live context needs.", "",
      "| max_model_len | " + " | ".join(f"{p} C={c}" for p, c in cols) + " |",
      "|---|" + "---|" * len(cols)]
  for m in meta["max_model_lens"]:
    cells = []
    for p, c in cols:
      pt = by.get((p, c, m))
      cells.append(f"{pt['round_ms']:.2f} / {pt['round_ms_min']:.2f} ({pt['vs_smallest_max_model_len']:.2f}x / "
                   f"{pt.get('min_vs_smallest_max_model_len', float('nan')):.2f}x)" if pt else "")
    lines.append(f"| {m} | " + " | ".join(cells) + " |")
  if meta.get("note"):
    lines += ["", f"Note: {meta['note']}"]
  return "\n".join(lines) + "\n"


def write_outputs(result: dict, output_dir: str | os.PathLike, name: str = "bench_context") -> tuple[str, str]:
  from recguide_jax import benchmarks as bench
  return bench.write_report(result, markdown(result), output_dir, name)


def _define_flags():
  from absl import flags

  from recguide_jax.benchmarks import cli
  d = ContextConfig()
  flags.DEFINE_string("model", None, "Checkpoint dir (default: the bundled model).")
  flags.DEFINE_list("max_model_lens", [str(m) for m in d.max_model_lens], "Engine max_model_len values.")
  flags.DEFINE_list("concurrency", [str(c) for c in d.concurrency], "Requests decoded together (C).")
  flags.DEFINE_integer("context", d.context, "Prompt tokens per request (the live context of the timed rounds).")
  flags.DEFINE_list("policies", list(d.policies), "ar and/or linear (LinearSS at --block_size).")
  flags.DEFINE_integer("block_size", d.block_size, "LinearSS block size.")
  flags.DEFINE_integer("rounds", d.rounds, "Decode rounds timed per generation.")
  flags.DEFINE_integer("repeats", d.repeats, "Timed generations per point.")
  flags.DEFINE_integer("page_size", d.page_size, "KV page size.")
  flags.DEFINE_enum("prompt_source", "auto", ["auto", "random", "gsm8k"], "Prompt tokens.")
  cli.define_data_flag("test", what="--prompt_source gsm8k")
  flags.DEFINE_enum("attention", "auto", ["auto", "reference", "pallas"], "Attention implementation.")
  flags.DEFINE_integer("decode_steps", d.decode_steps, "AR decode steps per device call (a timed AR round is one "
                       "call, its time shared by its steps).")
  cli.define_output_flags("bench_context")


def main(argv):
  del argv
  from absl import flags

  from bench_peer import quiet_logging

  from recguide_jax.benchmarks import cli
  f = flags.FLAGS
  quiet_logging()
  data = cli.data_path() if f.prompt_source == "gsm8k" else f.data or os.path.join(f.gsm8k_dir, "test.jsonl")

  def ints(name):
    try:
      return tuple(int(v) for v in f[name].value)
    except ValueError:
      sys.exit(f"error: --{name} must be integers, got {f[name].value}")

  cfg = ContextConfig(checkpoint=f.model, max_model_lens=ints("max_model_lens"), concurrency=ints("concurrency"),
                      context=f.context, policies=tuple(f.policies), block_size=f.block_size, rounds=f.rounds,
                      repeats=f.repeats, page_size=f.page_size, prompt_source=f.prompt_source,
                      data=data, attention=f.attention, decode_steps=f.decode_steps)
  try:
    cfg.validate()
  except ValueError as e:
    sys.exit(f"error: {e}")
  result = run_context(cfg)
  js, md = write_outputs(result, cli.output_dir())
  print(markdown(result))
  print(f"wrote {js} and {md}")


if __name__ == "__main__":
  _define_flags()
  from recguide_jax.benchmarks import cli
  cli.run(main)  # absl's app.run; --help / -h exit 0
