"""Compilation bookkeeping: the process-wide compile counter behind `compiles_after_warmup` (the guard that no
request ever waits on a compile), the persistent compilation cache, the background compiler that builds the
variants a server can start without, and the XLA options each variant compiles with.

Compiles that run on the background compiler's thread are not counted: they are planned work, not a request
waiting. Everything else that compiles after warm-up is.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import logging
import os
import platform
import queue
import threading
from typing import Any, Callable, Hashable, Iterable, Mapping

import jax

log = logging.getLogger(__name__)

_background = threading.local()

# XLA:CPU options chosen by measurement (docs/cpu_tuning.md): Eigen's dot instead of YNNPACK for products of few
# rows (weight on the right: up to 64 rows; weight on the left, the CPU default: matrix-vector only; never for
# bf16/fp16 weights, which Eigen converts in memory every step) ...
CPU_EIGEN_DOT_MAX_ROWS = 64
CPU_EIGEN_DOT_MAX_ROWS_WEIGHT_LEFT = 1
_NO_YNN_DOTS = ("xla_cpu_experimental_ynn_fusion_type", "")
# ... and the memory-optimized scheduler everywhere (it reuses temporaries the default one maps fresh each step)
_MEMORY_SCHEDULER = ("xla_cpu_scheduler_type", "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED")
_SPEED_ONLY = dict((_NO_YNN_DOTS, _MEMORY_SCHEDULER))  # options this module adds; none changes a result


def variant_compiler_options(configured: Mapping[str, Any], platform: str, query_rows: int,
                             weight_left: bool = False, narrow_weights: bool = False) -> dict[str, Any]:
  """The XLA options a step variant of `query_rows` rows (batch x query tokens) compiles with on `platform`: the
  configured ones, plus on the CPU the memory-optimized scheduler and, for at most `CPU_EIGEN_DOT_MAX_ROWS` rows,
  Eigen dots (each unless configured). `weight_left`: the model puts the weight on the left of its few-row dots
  (model.KernelLayout.OUT_IN); then only up to `CPU_EIGEN_DOT_MAX_ROWS_WEIGHT_LEFT` rows take Eigen dots, and none
  when the weights are `narrow_weights` (bf16/fp16)."""
  opts = dict(configured)
  if platform == "cpu":
    opts.setdefault(*_MEMORY_SCHEDULER)
    eigen_rows = ((0 if narrow_weights else CPU_EIGEN_DOT_MAX_ROWS_WEIGHT_LEFT) if weight_left
                  else CPU_EIGEN_DOT_MAX_ROWS)
    if query_rows <= eigen_rows:
      opts.setdefault(*_NO_YNN_DOTS)
  return opts


def compile_with_options(lowered, options: Mapping[str, Any], configured: Mapping[str, Any] = ()):
  """`lowered.compile` with `options`; an option this module added for speed that this jaxlib does not know (its
  name is in the error) is dropped with a warning, and the variant compiles with XLA's default for it."""
  opts = dict(options)
  while True:
    try:
      return lowered.compile(compiler_options=opts or None)
    except Exception as e:
      unknown = [k for k in opts if k in _SPEED_ONLY and k not in dict(configured) and k in str(e)]
      if not unknown:
        raise
      log.warning("this XLA does not take %s; compiling with its default", unknown[0])
      opts.pop(unknown[0])


class MappingLimitError(RuntimeError):
  """A compile refused because the process is near Linux's limit on memory mappings."""


MAPPINGS = "/proc/self/maps"
MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
# Memory mappings one step variant's code takes on XLA:CPU (a SmolLM2 RecGuide server's variants, on average): a few
# hundred for the program around the layers, and per layer when the layers are unrolled (scanned: compiled once)
SCAN_VARIANT_MAPPINGS = 470
UNROLLED_LAYER_MAPPINGS = 14


def variant_mappings(num_layers: int, unrolled: bool) -> int:
  """About how many memory mappings one compiled step variant takes on XLA:CPU."""
  return SCAN_VARIANT_MAPPINGS + (UNROLLED_LAYER_MAPPINGS * num_layers if unrolled else 0)


def _mapping_counts(maps: str | None, limit: str | None) -> tuple[int, int] | None:
  """(mappings this process holds, mappings Linux allows one: `vm.max_map_count`), None off Linux."""
  try:
    with open(limit or MAX_MAP_COUNT) as f:
      allowed = int(f.read().split()[0])
    with open(maps or MAPPINGS, "rb") as f:
      return sum(1 for _ in f), allowed
  except (OSError, ValueError, IndexError):
    return None


def _reserve(allowed: int) -> int:
  """The mappings `check_mapping_headroom` keeps free: 10% of those Linux allows, at least 4096."""
  return max(allowed // 10, 4096)


def mapping_room(maps: str | None = None, limit: str | None = None) -> int | None:
  """How many more memory mappings this process may take before `check_mapping_headroom` refuses compiles; None
  off Linux."""
  counts = _mapping_counts(maps, limit)
  return None if counts is None else counts[1] - _reserve(counts[1]) - counts[0]


def check_mapping_headroom(maps: str | None = None, limit: str | None = None) -> None:
  """Raises MappingLimitError when this process holds within 10% (at least 4096) of the memory mappings Linux allows
  it (`vm.max_map_count`, 65530 by default). XLA:CPU maps every executable's machine code into a few mappings per
  kernel (`variant_mappings`), and a compile past the limit crashes the process inside XLA: a server that holds
  very many variants gets this error instead. Nothing to check off Linux."""
  counts = _mapping_counts(maps, limit)
  if counts is not None and counts[0] + _reserve(counts[1]) > counts[1]:
    used, allowed = counts
    raise MappingLimitError(
        f"this process holds {used} memory mappings of the {allowed} Linux allows one (vm.max_map_count), and "
        "XLA:CPU maps each compiled step variant's code into a few hundred more: compiling another could crash the "
        "process. Serve fewer variants (a smaller --max_num_seqs: fewer batch buckets), run the layers scanned "
        "(--layer_loop scan: fewer mappings per variant) or raise the limit (sysctl -w vm.max_map_count=262144)")


class CompileCounter:
  """Counts backend compilations process-wide, except those on a background compiler's thread."""

  _lock = threading.Lock()
  _total = 0
  _background_total = 0
  _installed = False

  @classmethod
  def install(cls) -> None:
    with cls._lock:
      if cls._installed:
        return
      cls._installed = True

      def listener(event: str, duration: float, **kwargs) -> None:
        del duration, kwargs
        # jax reports this event on the thread that compiled, so the thread-local flag tells the two apart
        if event == "/jax/core/compile/backend_compile_duration":
          with cls._lock:
            if getattr(_background, "active", False):
              cls._background_total += 1
            else:
              cls._total += 1

      jax.monitoring.register_event_duration_secs_listener(listener)

  @classmethod
  def total(cls) -> int:
    """Compiles outside background compilers (what can have made a caller wait)."""
    return cls._total

  @classmethod
  def background_total(cls) -> int:
    return cls._background_total


def host_cpu_fingerprint(cpuinfo: str = "/proc/cpuinfo") -> str:
  """A short digest of this host's CPU model and instruction-set flags (from `cpuinfo` where there is one)."""
  text = platform.machine() + platform.processor()
  try:
    with open(cpuinfo) as f:
      for line in f:
        name = line.split(":", 1)[0].strip()
        if name in ("model name", "flags", "Features", "CPU part"):
          text += line
        elif not line.strip():
          break  # the first processor's entry is enough
  except OSError:
    pass
  return hashlib.sha256(text.encode()).hexdigest()[:12]


def compile_cache_path(directory: str | os.PathLike, platform_name: str) -> str:
  """Where `directory` keeps `platform_name`'s executables. jax keys an entry by program, flags and backend but not
  by the host CPU's instruction set, so XLA:CPU executables go to a subdirectory per CPU model: a cache shared by
  unlike hosts (a network home, a CI cache) never loads machine code built for another CPU."""
  if platform_name != "cpu":
    return os.fspath(directory)
  return os.path.join(directory, f"cpu-{host_cpu_fingerprint()}")


def enable_compile_cache(directory: str | None) -> None:
  """Persistent XLA compilation cache, so a restart reuses the previous run's executables."""
  if not directory:
    return
  directory = compile_cache_path(directory, jax.default_backend())
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


class BackgroundCompiler:
  """Compiles queued variants one at a time on a daemon thread, so a server answers while the variants it can
  do without (smaller batch buckets) are still being built; each finished one is handed to `on_done`. One thread:
  it takes at most one core from the steps that serve. `stop` drops what is still queued. At interpreter exit the
  compile in flight is waited for (an exit while XLA compiles on another thread aborts the process), the rest is
  dropped."""

  def __init__(self, compile_one: Callable[[Hashable], None], on_done: Callable[[Hashable], None]):
    self._compile_one = compile_one
    self._on_done = on_done
    # (priority, order, key): `submit(..., first=True)` goes before everything queued; None (priority -1) stops it
    self._queue: queue.PriorityQueue = queue.PriorityQueue()
    self._order = itertools.count()
    self._stopped = threading.Event()
    self._idle = threading.Event()
    self._idle.set()
    self._pending = 0
    self._lock = threading.Lock()
    self.failures: dict[Hashable, str] = {}
    self._thread = threading.Thread(target=self._loop, name="background-compile", daemon=True)
    self._thread.start()
    atexit.register(self.shutdown)

  def submit(self, keys: Iterable[Hashable], first: bool = False) -> None:
    """Queues `keys` in order; `first`: ahead of what is already queued (a variant a request is waiting for)."""
    for key in keys:
      with self._lock:
        self._pending += 1
        self._idle.clear()
      self._queue.put((0 if first else 1, next(self._order), key))

  @property
  def pending(self) -> int:
    return self._pending

  def wait(self, timeout: float | None = None) -> bool:
    """Blocks until everything submitted is compiled (or dropped); False on timeout."""
    return self._idle.wait(timeout)

  def stop(self) -> None:
    self._stopped.set()
    self._queue.put((-1, next(self._order), None))

  def shutdown(self, timeout: float | None = None) -> None:
    """`stop`, then wait for the compile in flight to end."""
    self.stop()
    self._thread.join(timeout)

  def _loop(self) -> None:
    _background.active = True
    while True:
      _, _, key = self._queue.get()
      if key is None:
        return
      try:
        if not self._stopped.is_set():
          self._compile_one(key)
          self._on_done(key)
      except Exception as e:  # a variant that fails to compile stays unrouted; the server keeps the rest
        self.failures[key] = f"{type(e).__name__}: {e}"
        log.exception("background compile of %s failed", key)
      finally:
        with self._lock:
          self._pending -= 1
          if self._pending == 0:
            self._idle.set()
