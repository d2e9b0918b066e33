"""OpenAI-compatible server: /v1/completions, /v1/chat/completions (plain and streamed), /v1/models, /health and
/metrics over one engine thread.

  python launch/serve.py --model=/ckpt/nld-8b --policy=linear --block_size=16 --port=8000
  python launch/serve.py /ckpt/nld-8b --api_key=secret     # the model may be given positionally (vllm serve)
  python launch/serve.py --max-num-seqs 4 --gpu-memory-utilization 0.8   # vLLM's dashed spellings work too

Before it loads anything it makes the memory plan (recguide_jax/cache/memory_plan.py) and logs it: weights, measured
activation peak and KV cache (GB, pages, tokens, sequences of --max_model_len); on a GPU or TPU the cache gets
what --gpu_memory_utilization (0.9) of the device's memory leaves, and a plan that does not fit is refused with
one `error:` line naming the figures and the flag to change. Flags are vLLM's names (--model, --max_num_seqs,
--gpu_memory_utilization, --max_model_len, --tensor_parallel_size, --data_parallel_size, --served_model_name,
--dtype), with dashes or underscores. Library logs (jax, orbax, absl) stay at WARNING unless --verbose.

It compiles every step variant the policy needs before it listens (a progress bar shows the compilation), then
prints the URL. SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight requests finish, drains the
engine and exits 0. A bad flag value prints one `error: --flag: ...` line and exits with status 1.
"""

import os
import signal
import socket
import sys
import time

# Runnable as a script from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags, logging  # noqa: E402

_MODEL = flags.DEFINE_string("model", None, "Checkpoint directory (config.json + params/ + tokenizer files), also "
                             "accepted as the one positional argument. Default: $RECGUIDE_CHECKPOINT, else the bundled "
                             "checkpoints/nld-tiny-gsm8k.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_POLICY = flags.DEFINE_string("policy", "recguide", "Decoding policy: recguide (the default: overlap, adaptive block "
                              "size or AR by load, with the tables shipped beside the model), ar, diffusion or linear "
                              "(LinearSS with a fixed --block_size).")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Draft / diffusion block size (>= 2).")
_THRESHOLD = flags.DEFINE_float("threshold", 0.9, "Confidence threshold of the diffusion policy, in (0, 1].")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 8, "Most requests decoded together (batch buckets 1, 2, 4, "
                                      "...).")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 0, "KV cache pages; 0: planned from device memory (see "
                                  "--gpu_memory_utilization), or on CPU room for --max_num_seqs full-length sequences.")
_GPU_MEMORY_UTILIZATION = flags.DEFINE_float(
    "gpu_memory_utilization", None, "Fraction of the device's memory the server may use (GPU, TPU); what the "
    "weights and the measured activation peak "
    "leave of it becomes KV pages. Default 0.9 where the device reports its memory (GPU, TPU) or "
    "--device_memory_gb states it; on CPU the cache is sized from the flags. On a GPU, jax's allocator may take "
    "XLA_PYTHON_CLIENT_MEM_FRACTION of the card (this server sets 0.95 unless it is set).")
_DEVICE_MEMORY_GB = flags.DEFINE_float("device_memory_gb", None, "Device memory in GB (10^9 bytes) for the memory "
                                       "plan, where the device does not report it (or to plan for less).")
_DTYPE = flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16", "float16"],
                           "Weights, activations and KV cache dtype; auto: the checkpoint's.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV cache page.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 1024, "Longest prompt + output, in tokens.")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 256, "Most requests waiting for a batch slot; more get HTTP 429.")
_PROFILE = flags.DEFINE_string("profile", None, "Hardware profile for the RecGuide policy: a JSON path from "
                               "launch/profile.py or a shipped profile name such as b200_nld8b (optional).")
_TABLES = flags.DEFINE_string("recguide_tables", None, "RecGuide's fitted adaptive-B tables JSON (default: "
                              "<checkpoint>/recguide_tables.json, when it "
                              "exists; likewise the profile defaults to <checkpoint>/profile.json).")
_OVERLAP_MAX_TEMPERATURE = flags.DEFINE_float(
    "recguide_overlap_max_temperature", 0.3, "Requests of at most this temperature may run RecGuide's overlap rounds "
    "(0: greedy requests only). Lossless at any temperature, but a sampled request accepts the argmax draft less "
    "often than LinearSS's sampled one at higher temperatures (docs/recguide.md).")
_OVERLAP_BLOCK_SIZES = flags.DEFINE_list(
    "recguide_overlap_block_sizes", ["8", "16", "32"], "The block sizes RecGuide's overlap rounds may run at; the "
    "switch prices each per step and runs the best (docs/recguide.md, \"One forward per step\").")
_VERIFY_TRUNCATION = flags.DEFINE_boolean(
    "recguide_verify_truncation", False, "On ragged steps (--bucketing=ragged), each LinearSS row verifies only the "
    "head of its draft whose running confidence pays for the verify tokens at the load, priced with the hardware "
    "profile (lossless; docs/ragged.md).")
_BUCKETING = flags.DEFINE_enum(
    "bucketing", "auto", ["auto", "per_block", "padded", "ragged"], "How a step's requests planned at different "
    "block sizes run: auto (whichever the policy's cost model prices cheaper per step), per_block (a batch per "
    "block size), padded (one batch padded to the largest block) or ragged (one draft + one verify forward, each "
    "row at its own block).")
_ATTENTION = flags.DEFINE_enum("attention", "auto", ["auto", "reference", "pallas"],
                               "Attention implementation: Pallas kernels on GPU/TPU, the jnp reference on CPU.")
_LAYER_LOOP = flags.DEFINE_enum("layer_loop", "auto", ["auto", "scan", "unrolled"],
                                "How the forward runs the decoder layers: scan (stacked weights, compiled once; "
                                "TPU), unrolled (a module per layer: XLA:CPU and XLA:GPU copy every weight a scan "
                                "slices, in every step), auto (unrolled on GPUs, and on a CPU device without a mesh "
                                "when the weights exceed its last-level cache and the step variants fit Linux's "
                                "memory-mapping limit unrolled; else scan).")
_KERNEL_LAYOUT = flags.DEFINE_enum("kernel_layout", "auto", ["auto", "in_out", "out_in"],
                                   "How the dense layers hold their kernels: in_out (the checkpoint's; GPU/TPU, "
                                   "meshes), out_in (transposed at load; XLA:CPU runs decode-sized matmuls with "
                                   "the weight on the left about 2x faster, a batch-8 decode step 1.3x), auto "
                                   "(out_in on a CPU device without a mesh, else in_out).")
_PROJECTION_FUSION = flags.DEFINE_enum("projection_fusion", "auto", ["auto", "separate", "fused"],
                                       "Whether q/k/v and gate/up run as one matmul each: separate (the "
                                       "checkpoint's; meshes), fused (concatenated at load, vLLM's merged "
                                       "projections; not under a mesh), auto (fused on a CPU device without a mesh, "
                                       "else separate).")
_DECODE_STEPS = flags.DEFINE_integer(
    "decode_steps", 4,  # llm.DEFAULT_DECODE_STEPS (not imported here: --help stays light)
    "AR decode steps one device call may run while no request waits to be admitted or prefilled (vLLM's multi-step "
    "scheduling): one dispatch, one read-back and one round of host work per that many tokens; streams then get "
    "tokens in groups of up to that many. 1 turns it off; at most the largest block size or prefill chunk.",
    lower_bound=1)
_BACKGROUND_COMPILE = flags.DEFINE_boolean(
    "background_compile", True, "Compile only the largest batch bucket of each step variant before serving and the "
    "smaller buckets on a background thread (their batches run padded in the largest until then). Variants warm-up "
    "does not plan (sampling controls, prompt scoring) are compiled there too, on first use, while only the "
    "requests that need them wait. --nobackground_compile compiles everything first.")
_WARMUP_PROMPT_LOGPROBS = flags.DEFINE_boolean(
    "warmup_prompt_logprobs", False, "Also compile the prefill variant that scores the prompt (echo with logprobs, "
    "lm-eval's loglikelihood) before serving; by default the first such request waits for it.")
_ENABLE_PREFIX_CACHING = flags.DEFINE_boolean(
    "enable_prefix_caching", True, "Automatic prefix caching (vLLM's, on by default): full KV pages of prompts are "
    "kept and shared by their token prefix, so requests repeating a system prompt or few-shot examples prefill only "
    "the rest. --no-enable-prefix-caching turns it off.")
_COMPILE_CACHE_DIR = flags.DEFINE_string("compile_cache_dir", None, "Persistent XLA compilation cache. Default: "
                                         "$RECGUIDE_COMPILE_CACHE or ~/.cache/recguide_jax/xla; '' disables it.")
_SERVED_MODEL_NAME = flags.DEFINE_string("served_model_name", None, "Model name clients pass as `model`. Default: "
                                         "the checkpoint directory's name.")
_RULE = flags.DEFINE_enum("rule", "leviathan", ["leviathan", "reference"], "Speculative acceptance rule.")
_ACCESS_LOG = flags.DEFINE_boolean("access_log", False, "Log every HTTP request.")
_API_KEY = flags.DEFINE_string("api_key", None, "Require 'Authorization: Bearer <key>' on /v1/* (401 otherwise); "
                               "/health, /metrics, /version, /tokenize, /detokenize stay open. Default: "
                               "$RECGUIDE_API_KEY if set, else no authentication.")
_ALLOWED_ORIGINS = flags.DEFINE_list("allowed_origins", [], "CORS: comma-separated origins allowed to call the API "
                                     "from a browser ('*' for any). Default: none (no CORS headers).")
_STRICT_REQUEST_FIELDS = flags.DEFINE_boolean("strict_request_fields", False, "Answer unknown request fields with "
                                              "400 (default: ignore them with a logged warning, as vLLM does).")
from recguide_jax.parallel import multihost as distributed  # noqa: E402

# --tensor_parallel_size/--data_parallel_size/--mesh and the multi-host flags (docs: README "Scale-out")
distributed.define_mesh_flags()
_VERBOSE = flags.DEFINE_boolean("verbose", False, "Log the libraries' INFO lines too (jax, orbax, absl: checkpoint "
                                "reads, compilation); by default they are kept at WARNING.")
_LOG_STATS_INTERVAL = flags.DEFINE_float("log_stats_interval", 10.0, "Seconds between the engine stats lines "
                                         "(throughput, running/waiting, KV cache usage, acceptance) in the log while "
                                         "there is activity, as vLLM logs them; 0 disables.")


def _fail(message: str) -> None:
  print("error: " + " ".join(str(message).split()), file=sys.stderr)  # one line, whatever the exception held
  sys.exit(1)


def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(e)


def _check(ok: bool, flag: str, message: str) -> None:
  if not ok:
    _fail(f"--{flag}: {message}")


BUCKETING = {"auto": "auto", "per_block": True, "padded": False, "ragged": "ragged"}  # --bucketing -> LLM's


def _check_flags() -> None:
  """Checks that need no jax, so a typo is reported at once rather than after loading the model."""
  _check(bool(_HOST.value), "host", "must not be empty")
  _check(1 <= _PORT.value <= 65535, "port", f"must be in [1, 65535], got {_PORT.value}")
  _check(_BLOCK_SIZE.value >= 2, "block_size", f"must be >= 2, got {_BLOCK_SIZE.value}")
  _check(0 < _THRESHOLD.value <= 1, "threshold", f"must be in (0, 1], got {_THRESHOLD.value}")
  _check(_MAX_NUM_SEQS.value >= 1, "max_num_seqs", f"must be >= 1, got {_MAX_NUM_SEQS.value}")
  _check(_OVERLAP_MAX_TEMPERATURE.value >= 0, "recguide_overlap_max_temperature",
         f"must be >= 0, got {_OVERLAP_MAX_TEMPERATURE.value}")
  blocks = _OVERLAP_BLOCK_SIZES.value
  _check(bool(blocks) and all(b in ("8", "16", "32") for b in blocks), "recguide_overlap_block_sizes",
         f"must be a non-empty list of 8, 16 and 32, got {','.join(blocks)!r}")
  _check(not _VERIFY_TRUNCATION.value or _BUCKETING.value == "ragged", "recguide_verify_truncation",
         "truncates the verifies of ragged steps: pass --bucketing=ragged too")
  _check(_NUM_PAGES.value == 0 or _NUM_PAGES.value >= 2, "num_pages",
         f"must be 0 (auto) or >= 2, got {_NUM_PAGES.value}")
  fraction = _GPU_MEMORY_UTILIZATION.value
  _check(fraction is None or 0 < fraction <= 1, "gpu_memory_utilization", f"must be in (0, 1], got {fraction}")
  memory = _DEVICE_MEMORY_GB.value
  _check(memory is None or memory > 0, "device_memory_gb", f"must be > 0, got {memory}")
  _check(_PAGE_SIZE.value >= 1, "page_size", f"must be >= 1, got {_PAGE_SIZE.value}")
  _check(_MAX_MODEL_LEN.value >= 2, "max_model_len", f"must be >= 2, got {_MAX_MODEL_LEN.value}")
  _check(_MAX_QUEUE.value >= 1, "max_queue", f"must be >= 1, got {_MAX_QUEUE.value}")
  _check(_API_KEY.value is None or bool(_API_KEY.value.strip()), "api_key", "must not be empty")
  _check(_LOG_STATS_INTERVAL.value >= 0, "log_stats_interval", f"must be >= 0, got {_LOG_STATS_INTERVAL.value}")
  _check(_SERVED_MODEL_NAME.value is None or bool(_SERVED_MODEL_NAME.value.strip()), "served_model_name",
         "must not be empty")
  cache = _COMPILE_CACHE_DIR.value
  _check(not cache or not os.path.exists(cache) or os.path.isdir(cache), "compile_cache_dir",
         f"{cache} exists and is not a directory")
  if _PROFILE.value is not None:
    from recguide_jax.recguide import profile as prof_lib
    try:
      prof_lib.load_profile(_PROFILE.value)  # a path, or the name of a shipped profile
    except (OSError, ValueError) as e:
      _fail(f"--profile: {e}")


def _check_checkpoint(path: str) -> None:
  _check(os.path.isdir(path), "model", f"{path} is not a directory")
  _check(os.path.isfile(os.path.join(path, "config.json")), "model", f"{path} has no config.json")
  _check(os.path.isfile(os.path.join(path, "tokenizer.json")), "model",
         f"{path} has no tokenizer.json (the server needs a tokenizer to read prompts and write text)")
  import json
  try:
    with open(os.path.join(path, "config.json")) as f:
      limit = json.load(f).get("max_position_embeddings")
  except (OSError, ValueError) as e:
    _fail(f"--model: {path}/config.json: {e}")
  # past it positions are untrained, and the KV cache would be sized for sequences the model cannot serve
  _check(not isinstance(limit, int) or _MAX_MODEL_LEN.value <= limit, "max_model_len",
         f"{_MAX_MODEL_LEN.value} exceeds the model's max_position_embeddings {limit}; use at most {limit}")


def _check_port(host: str, port: int) -> None:
  """Fails before the minutes of loading and compiling if the address cannot be bound."""
  try:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
  except socket.gaierror as e:
    _fail(f"--host: cannot resolve {host}: {e}")
  family, _, _, _, addr = infos[0]
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
      s.bind(addr)
    except OSError as e:
      _fail(f"--port: cannot listen on {host}:{port}: {e.strerror}")


def _make_policy(checkpoint: str):
  """Builds the policy. RecGuide takes the hardware profile (--profile, a path or a shipped profile name) and the
  adaptive-B tables shipped beside the checkpoint (recguide_tables.json) when present."""
  from recguide_jax.decoding.registry import make_strategy, strategy_names
  name = _POLICY.value
  _check(name in strategy_names(), "policy", f"unknown policy {name!r}; expected one of "
         f"{', '.join(strategy_names())}")
  kwargs = {}
  if name == "recguide":
    from recguide_jax import llm as llm_lib
    from recguide_jax.recguide import adaptive, profile as prof_lib
    try:
      kwargs = llm_lib.recguide_defaults(checkpoint)  # tables and profile shipped beside the checkpoint
    except (OSError, ValueError) as e:
      _fail(f"--model: {e}")
    if _PROFILE.value is not None:
      try:
        kwargs["profile"] = prof_lib.load_profile(_PROFILE.value)
      except (OSError, ValueError) as e:
        _fail(f"--profile: {e}")
    if _TABLES.value:
      try:
        kwargs["tables"] = adaptive.load_tables(_TABLES.value)
      except (OSError, ValueError) as e:
        _fail(f"--recguide_tables: {e}")
    kwargs["overlap_max_temperature"] = _OVERLAP_MAX_TEMPERATURE.value
    kwargs["overlap_block_sizes"] = tuple(int(b) for b in _OVERLAP_BLOCK_SIZES.value)
    kwargs["verify_truncation"] = _VERIFY_TRUNCATION.value
  elif _PROFILE.value is not None:
    logging.info("--profile %s is stored; the %s policy does not use a hardware profile", _PROFILE.value, name)
  try:
    policy = make_strategy(name, _BLOCK_SIZE.value, _THRESHOLD.value, **kwargs)
  except ValueError as e:
    _fail(f"--policy={name}: {e}")
  return policy


def _exit_after_shutdown(signum, frame):
  # uvicorn catches SIGTERM / SIGINT itself, shuts down gracefully, then re-raises the signal to the handler it
  # found: this one, so the process ends with a status instead of a signal death or a KeyboardInterrupt traceback
  raise SystemExit(0 if signum == signal.SIGTERM else 128 + signum)


def _positional_checkpoint(argv) -> None:
  """`serve.py MODEL` as `vllm serve MODEL`: one positional argument is the checkpoint directory."""
  if len(argv) > 2:
    _fail(f"unexpected arguments {argv[2:]} (only one positional argument, the checkpoint directory, is accepted)")
  if len(argv) == 2:
    given = _MODEL.value
    if given is not None and os.path.normpath(given) != os.path.normpath(argv[1]):
      _fail(f"--model: {given} and the positional model {argv[1]} disagree; pass one")
    flags.FLAGS.model = argv[1]


def curl_example(host: str, port: int, model: str, api_key: bool) -> str:
  """A ready-to-run request against this server (printed once it listens)."""
  if host in ("0.0.0.0", "::", ""):
    host = "127.0.0.1"
  elif ":" in host:
    host = f"[{host}]"
  auth = ' -H "Authorization: Bearer $RECGUIDE_API_KEY"' if api_key else ""
  body = ('{"model": "%s", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 32}'
          % model.replace('"', '\\"'))
  return (f"curl http://{host}:{port}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
          f"-d '{body}'")


def _quiet_libraries() -> None:
  """jax, orbax and absl log every checkpoint read and compile at INFO: WARNING unless --verbose (orbax logs through
  absl's logger). The server's own lines (engine stats, shutdown) stay at INFO."""
  import logging as std_logging
  level = std_logging.INFO if _VERBOSE.value else std_logging.WARNING
  for name in ("jax", "orbax", "absl"):
    std_logging.getLogger(name).setLevel(level)


def main(argv):
  _positional_checkpoint(argv)
  _quiet_libraries()
  _check_flags()
  host, port = _HOST.value, _PORT.value
  _check_port(host, port)
  signal.signal(signal.SIGTERM, _exit_after_shutdown)
  signal.signal(signal.SIGINT, _exit_after_shutdown)
  # jax's GPU allocator takes 75 % of the card by default; let it take 95 % so that --gpu_memory_utilization
  # (of what the allocator may hand out) means about what vLLM's flag means. Before jax loads.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

  # Imported only now so that bad flags are reported at once, before jax loads.
  import uvicorn

  from recguide_jax import llm as llm_lib
  from recguide_jax.model.checkpoint import CheckpointError
  from recguide_jax.model.config import ConfigError
  from recguide_jax.engine.gc_heap import freeze_startup_heap
  from recguide_jax.engine.thread import EngineThread
  from recguide_jax.server.app import create_app
  from recguide_jax.text.tokenizer import TokenizerError

  try:  # before anything touches a device: a multi-host run joins its processes first
    distributed.initialize_from_flags()
    mesh = distributed.mesh_from_flags()
  except ValueError as e:
    _fail(e)
  checkpoint = _MODEL.value or str(llm_lib.default_checkpoint())
  _check_checkpoint(checkpoint)
  policy = _make_policy(checkpoint)
  cache = _COMPILE_CACHE_DIR.value
  cache = llm_lib.DEFAULT_COMPILE_CACHE if cache is None else (cache or None)
  name = _SERVED_MODEL_NAME.value or os.path.basename(os.path.normpath(os.path.abspath(checkpoint)))

  print(f"loading {checkpoint} (policy {_POLICY.value}, block size {_BLOCK_SIZE.value}, max_num_seqs "
        f"{_MAX_NUM_SEQS.value}, max_model_len {_MAX_MODEL_LEN.value}, dtype {_DTYPE.value})", flush=True)
  t0 = time.perf_counter()
  try:
    llm = llm_lib.LLM(checkpoint, policy, _BLOCK_SIZE.value, threshold=_THRESHOLD.value,
                      max_num_seqs=_MAX_NUM_SEQS.value,
                      max_model_len=_MAX_MODEL_LEN.value, num_pages=_NUM_PAGES.value or None,
                      page_size=_PAGE_SIZE.value, rule=_RULE.value, compile_cache_dir=cache, warmup=True,
                      max_queue=_MAX_QUEUE.value, attention=_ATTENTION.value, dtype=_DTYPE.value,
                      gpu_memory_utilization=_GPU_MEMORY_UTILIZATION.value, device_memory_gb=_DEVICE_MEMORY_GB.value,
                      background_compile=_BACKGROUND_COMPILE.value, mesh=mesh,
                      warmup_prompt_logprobs=_WARMUP_PROMPT_LOGPROBS.value, layer_loop=_LAYER_LOOP.value,
                      kernel_layout=_KERNEL_LAYOUT.value, projection_fusion=_PROJECTION_FUSION.value,
                      decode_steps=_DECODE_STEPS.value, bucketing=BUCKETING[_BUCKETING.value],
                      enable_prefix_caching=_ENABLE_PREFIX_CACHING.value)
  except (CheckpointError, ConfigError, TokenizerError, OSError) as e:
    _fail(f"--model: {e}")
  except ValueError as e:
    _fail(e)
  print(f"loaded and compiled in {time.perf_counter() - t0:.1f} s; {llm.memory_plan.summary()}",
        flush=True)  # the plan is also logged before the weights load (absl INFO, shown with --verbose)

  if not distributed.is_leader():  # a multi-host follower: run the leader's steps until it stops
    freeze_startup_heap()
    distributed.follow(llm.runner)
    return
  leader = distributed.lead(llm.runner) if distributed.process_count() > 1 else None
  engine_thread = EngineThread(llm.engine).start()
  try:
    api_key = _API_KEY.value or os.environ.get("RECGUIDE_API_KEY") or None
    fastapi_app = create_app(engine_thread, llm.tokenizer, name, profile=_PROFILE.value,
                             log_stats_interval_s=_LOG_STATS_INTERVAL.value,
                             strict_request_fields=_STRICT_REQUEST_FIELDS.value, api_key=api_key,
                             allowed_origins=_ALLOWED_ORIGINS.value)
    url = f"http://{host}:{port}/v1"

    class Server(uvicorn.Server):

      async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
          # no full collection walks the start-up heap while the engine decodes (a 100-300 ms pause each)
          freeze_startup_heap()
          print(f"serving {name} at {url}", flush=True)
          print("try it: " + curl_example(host, port, name, api_key is not None), flush=True)

    config = uvicorn.Config(fastapi_app, host=host, port=port, log_level="info", access_log=_ACCESS_LOG.value,
                            timeout_graceful_shutdown=None, lifespan="on")
    Server(config).run()
  finally:
    engine_thread.shutdown(drain=True)  # already done by the app on a graceful exit; a no-op then
    if leader is not None:
      leader.stop()


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli  # dashed flag names and --help as every launch script
  cli.run(main, flags_parser=_parse_flags)
