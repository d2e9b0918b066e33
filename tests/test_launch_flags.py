"""The launch scripts' flag vocabulary (recguide_jax/benchmarks/cli.py): every command line quoted in README.md,
docs/*.md, the model card and the scripts' own docstrings still parses; vLLM's dashed spellings land on the
underscored flags and retired names are unknown flags; reports default to runs/<script>, never docs/; `-h` exits 0
and lists the flags of the modules a script uses; a missing GSM8K file is one error line naming
the flags and $RECGUIDE_GSM8K_DIR.

The scripts are parsed in ONE subprocess (jax is imported once): each is executed as __main__ with absl's app.run
replaced by "parse the flags and return", and the flags it defined are removed before the next one."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "launch").glob("*.py"))
GSM8K_ENV_DIR = "/nonexistent/gsm8k-for-the-test"

# Parses each case [script, argv] as the script would; prints one JSON result per case.
HARNESS = r"""
import contextlib, io, json, os, runpy, sys
from absl import app, flags
ROOT = sys.argv[1]
cases = json.loads(sys.argv[2])
sys.path.insert(0, ROOT)
FLAGS = flags.FLAGS
real_run = app.run
out = []
for script, argv, probe in cases:
  before = set(FLAGS)
  res = {"script": script, "argv": argv}
  parsed = {}

  def fake_run(main, argv=None, flags_parser=None, **kw):
    parsed["rest"] = (flags_parser or app.parse_flags_with_usage)(sys.argv)

  app.run = fake_run
  sys.argv = [os.path.join(ROOT, "launch", script + ".py")] + argv
  sys.path.insert(0, os.path.join(ROOT, "launch"))
  buf = io.StringIO()
  try:
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
      runpy.run_path(sys.argv[0], run_name="__main__")
    res["ok"] = "rest" in parsed
    res["values"] = {n: FLAGS[n].value for n in probe if n in FLAGS}
    res["defaults"] = {n: FLAGS[n].default for n in ("output_dir", "gsm8k_dir") if n in FLAGS}
    if "data" in FLAGS and "gsm8k_dir" in FLAGS:
      from recguide_jax.benchmarks import cli
      try:
        res["data_path"] = cli.data_path()
      except SystemExit as e:
        res["data_error"] = str(e.code)
  except SystemExit as e:
    res["ok"], res["exit"] = False, e.code if isinstance(e.code, int) else str(e.code)
  except Exception as e:  # noqa: BLE001
    res["ok"], res["error"] = False, f"{type(e).__name__}: {e}"
  res["output"] = buf.getvalue()[-2000:]
  out.append(res)
  sys.path.remove(os.path.join(ROOT, "launch"))
  app.run = real_run
  FLAGS.unparse_flags()
  for name in set(FLAGS) - before:
    delattr(FLAGS, name)
print("@@" + json.dumps(out, default=str))
"""


def _parse(cases, env_dir=GSM8K_ENV_DIR):
  env = dict(os.environ, JAX_PLATFORMS="cpu", RECGUIDE_GSM8K_DIR=env_dir)
  proc = subprocess.run([sys.executable, "-c", HARNESS, str(ROOT), json.dumps(cases)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(proc.stdout.split("@@", 1)[1])


def _command_argv(tail: str) -> list[str]:
  """The arguments of a quoted command: up to a shell operator, a closing parenthesis, a sentence's colon or the
  quote that closes a string the command is quoted in."""
  try:
    tokens = list(_lexer(tail))
  except ValueError:  # an unbalanced quote: the command sits inside a quoted string, which ends there
    tokens = list(_lexer(tail[:max(tail.rfind('"'), tail.rfind("'"))]))
  argv = []
  for tok in tokens:
    if tok and tok[0] in "();<>|&":
      break
    argv.append(tok.rstrip(":"))
    if tok.endswith(":"):
      break
  return argv


def _lexer(text: str) -> shlex.shlex:
  lex = shlex.shlex(text, posix=True, punctuation_chars=True)
  lex.whitespace_split = True
  return lex


def quoted_commands() -> list[tuple[str, str, list[str]]]:
  """(where, script, argv) of every `python launch/<script>.py ...` quoted in the docs and the scripts' docstrings
  (indented example lines); pseudo-syntax (`[--flag a|b]`, `<x>`, `...`) is left out."""
  sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("checkpoints/*/*.md")),
             *sorted((ROOT / "launch").glob("*.py"))]
  found = []
  for path in sources:
    text = path.read_text().replace("\\\\\n", " ").replace("\\\n", " ")  # a docstring's `\\` or a shell's `\`
    # docs: `python launch/x.py ...`, or `launch/x.py --flag ...` inside a sentence; scripts: docstring example lines
    pattern = (r"^[ \t]+(python )launch/(\w+)\.py([^\n]*)" if path.suffix == ".py" else
               r"(python )?launch/(\w+)\.py([^\n`]*)")
    for m in re.finditer(pattern, text, flags=re.M):
      if not m.group(1) and not m.group(3).startswith(" -"):
        continue
      argv = _command_argv(m.group(3))
      if any(a.startswith("[") or "..." in a for a in argv):
        continue
      found.append((f"{path.relative_to(ROOT)}: {m.group(0).strip()[:100]}", m.group(2), argv))
  return found


def test_every_quoted_command_parses():
  cmds = quoted_commands()
  assert len(cmds) >= 20 and {"benchmark", "bench_recguide", "serve"} <= {s for _, s, _ in cmds}
  results = _parse([[s, argv, []] for _, s, argv in cmds])
  bad = [f"{where}\n  -> {r.get('exit') or r.get('error')}: {r['output'][-300:]}" for (where, _, _), r in
         zip(cmds, results) if not r["ok"]]
  assert not bad, "\n".join(bad)


# (script, argv as a vLLM user types it, {flag: value expected}): dashed spellings land on the underscored flags
SPELLINGS = [
    ("serve", ["--max-num-seqs", "4", "--gpu-memory-utilization=0.5", "--tensor-parallel-size=2"],
     {"max_num_seqs": 4, "gpu_memory_utilization": 0.5, "tensor_parallel_size": 2}),
    ("serve", ["--max_num_seqs=4", "--data-parallel-size", "2", "--served-model-name=x"],
     {"max_num_seqs": 4, "data_parallel_size": 2, "served_model_name": "x"}),
    ("benchmark", ["--max-model-len=512", "--num-prompts", "3", "--output-dir=/tmp/x"],
     {"max_model_len": 512, "num_prompts": 3, "output_dir": "/tmp/x"}),
    ("bench_serving", ["--base-url=http://127.0.0.1:1", "--dataset-path=/tmp/p.jsonl"],
     {"base_url": "http://127.0.0.1:1", "dataset_path": "/tmp/p.jsonl"}),
    ("bench_serving", ["--dataset-name=random", "--random-input-len", "64", "--max-concurrency=4",
                       "--metric-percentiles=50,99"],
     {"dataset_name": "random", "random_input_len": 64, "max_concurrency": 4, "metric_percentiles": ["50", "99"]}),
    ("fuzz_server", ["--base-url=http://127.0.0.1:1", "--max-num-seqs=2"],
     {"base_url": "http://127.0.0.1:1", "max_num_seqs": 2}),
    ("convert_checkpoint", ["--hf-dir=/a", "--output-dir=/b"], {"hf_dir": "/a", "output_dir": "/b"}),
]
# names retired for one name per concept: each is now an unknown flag
RETIRED = [("serve", "--max_batch=4"), ("serve", "--kv_cache_memory_fraction=0.5"), ("serve", "--checkpoint=x"),
           ("serve", "--tp=2"), ("serve", "--policy_tables=x"), ("benchmark", "--batch_sizes=1"),
           ("benchmark", "--out_json=x"), ("benchmark", "--checkpoint=x"), ("train", "--out_dir=x"),
           ("fuzz_server", "--url=x"), ("compile_bench", "--max_batch=2"), ("bench_kernels", "--batch=1"),
           ("aot_cost_analysis", "--output=x")]
# one name per concept: no script or module flag under another name for output, batch, server URL or model
RETIRED_NAMES = {"out", "out_dir", "output", "out_json", "out_md", "max_batch", "batch", "url", "checkpoint", "tp",
                 "dp", "kv_cache_memory_fraction"}
# scripts that write reports (default runs/<script>), build a model (--model, --dtype) or read one GSM8K split
REPORTS = ["bench_context", "bench_kernels", "bench_peer", "bench_recguide", "benchmark", "compile_bench",
           "device_check", "eval_model", "fit_delta", "profile"]
MODELS = ["bench_peer", "bench_recguide", "benchmark", "device_check", "distill_lora", "eval_model", "fit_delta",
          "profile", "serve", "shadow_trace"]
DATA = {"bench_context": "test", "bench_peer": "test", "bench_recguide": "test", "benchmark": "test",
        "distill_lora": "train", "eval_model": "test", "fit_delta": "train", "shadow_trace": "train"}


def test_dashed_names_one_name_per_concept_and_defaults_follow_the_vocabulary():
  cases = [[s, argv, list(want)] for s, argv, want in SPELLINGS]
  cases += [[s, [arg], []] for s, arg in RETIRED]
  cases += [[s, [], ["model", "dtype", "max_model_len"]] for s in MODELS]
  cases += [[s, [], []] for s in REPORTS]
  results = _parse(cases)
  for (s, _, want), r in zip(SPELLINGS, results):
    assert r["ok"], (s, r)
    assert r["values"] == want, (s, r["values"])
  retired = results[len(SPELLINGS):len(SPELLINGS) + len(RETIRED)]
  for (s, arg), r in zip(RETIRED, retired):
    name = arg[2:].split("=")[0]
    assert not r["ok"] and f"Unknown command line flag '{name}'" in r["output"], (s, arg, r)
  rest = results[len(SPELLINGS) + len(RETIRED):]
  models = rest[:len(MODELS)]
  for s, r in zip(MODELS, models):
    assert r["ok"] and {"model"} <= set(r["values"]), (s, r)
    if s != "bench_peer":  # bench_peer sweeps --dtypes
      assert r["values"]["dtype"] in ("auto", "bfloat16"), (s, r["values"])
  for r in rest:
    s = r["script"]
    if s in REPORTS:
      out = r["defaults"]["output_dir"]
      assert pathlib.PurePath(out).parts[-2:] == ("runs", s), (s, out)
    if s in DATA:  # the env var names the folder; the file is <split>.jsonl in it; missing: an error naming flags
      assert r["defaults"]["gsm8k_dir"] == GSM8K_ENV_DIR
      err = r["data_error"]
      assert f"{GSM8K_ENV_DIR}/{DATA[s]}.jsonl not found" in err and "--data" in err and "RECGUIDE_GSM8K_DIR" in err


def test_no_flag_defined_under_a_retired_name():
  sources = [*(ROOT / "launch").glob("*.py"), *(ROOT / "recguide_jax").rglob("*.py")]
  defined = {(p.relative_to(ROOT).as_posix(), m.group(1)) for p in sources
             for m in re.finditer(r"DEFINE_\w+\(\s*[\"'](\w+)[\"']", p.read_text())}
  assert len(defined) > 100
  assert not {(f, n) for f, n in defined if n in RETIRED_NAMES}


@pytest.mark.parametrize("script", ["benchmark", "fit_delta"])
def test_missing_gsm8k_is_one_error_line(script, tmp_path):
  """Before any model is loaded: exit status 1, the flag and the env var named, no traceback."""
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / f"{script}.py"), f"--gsm8k_dir={tmp_path}"],
                        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert f"error: --data: GSM8K file {tmp_path}" in proc.stderr and "--gsm8k_dir" in proc.stderr


def test_help_exits_zero_and_lists_the_flags_of_used_modules():
  """Every launch script runs through `cli.run`, so `-h` / `--help` exit 0 as in vLLM, and list the flags defined by
  the modules the script uses (cli's --model/--data, distributed's mesh flags), not only the script's own."""
  results = _parse([[s, ["-h"], []] for s in SCRIPTS])
  for s, r in zip(SCRIPTS, results):
    assert r.get("exit") == 0 and not r.get("error") and "\n  --" in r["output"], (s, r)
  helps = {s: r["output"] for s, r in zip(SCRIPTS, results)}
  for flag in ("--model", "--data", "--num_prompts", "--max_tokens", "--tensor_parallel_size"):
    assert f"\n  {flag}:" in helps["benchmark"], flag
