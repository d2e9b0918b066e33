"""Mesh flags, multi-host start and the leader/follower step loop.

Flags (`define_mesh_flags()`, once per absl script): `--tensor_parallel_size`, `--data_parallel_size`
or one `--mesh dp=2,tp=4`; `--coordinator_address`, `--num_processes`, `--process_id` for
`jax.distributed.initialize`, or `--multihost` alone to let it discover them (TPU pod slices, SLURM, Open MPI).

Multi-host (multi-controller JAX): every process runs the same program on the global mesh, and each step must be
issued by every process, with the same inputs, in the same order. One process (process 0, the leader) serves HTTP
and runs the engine; its runner's `before_execute` hook publishes each step's (StepKey, host arguments) on
jax.distributed's key-value store, and every other process (a follower) loops `follow(runner)`: it reads the next
step and calls `runner.execute` with the same arguments, so the same compiled programs run everywhere and their
collectives meet. Host inputs are numpy arrays: each process puts the same value onto the replicated input
sharding. A device array among the arguments (a VERIFY's draft distributions, an output of the preceding DRAFT)
travels as a reference to that earlier step's output, which every follower holds from its own run of it.

Why the key-value store rather than a device broadcast (`multihost_utils.broadcast_one_to_all`): a follower does
not know the next step's shapes before it arrives, and a device broadcast of each new shape is a program of its
own, compiled after warm-up; the store carries bytes of any size through the coordinator with no compile.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
from typing import Any

# jax (and sharding.py, which imports it) load on first use, not here: launch scripts define these flags before
# jax loads, so a bad flag is reported at once

_FLAG_VALUES = None  # where define_mesh_flags put the flags (absl's FLAGS unless a test passes its own)
STEP_PREFIX = "recguide/step"
# device outputs a later step may take as an argument (a VERIFY takes the preceding DRAFT's distributions): each
# process keeps those of this many recent steps (a draft's [b, B, V] distributions are large on a real model)
OUTPUT_WINDOW = 4
KEEP_STEPS = 256  # published steps kept in the store; followers are at most a few steps behind (they share
#                   every step's collectives with the leader, so the leader cannot run far ahead of them)


def define_mesh_flags(flag_values=None) -> None:
  """Defines the mesh and multi-host flags on `flag_values` (default: absl's FLAGS). Idempotent: a script and a
  module it imports may both call it."""
  global _FLAG_VALUES
  from absl import flags
  fv = flags.FLAGS if flag_values is None else flag_values
  _FLAG_VALUES = fv
  if "mesh" in fv:
    return
  import sys
  caller = sys._getframe(1).f_globals.get("__name__", "")
  # listed under the calling script in its -h (absl keys a script's flags by its path), not under this module
  kw = dict(flag_values=fv, module_name=sys.argv[0] if caller in ("__main__", "") else caller)
  flags.DEFINE_integer("tensor_parallel_size", None, "Devices each dp group splits the model over (attention heads, "
                       "MLP columns, vocabulary, KV heads). Default 1, or what --mesh says.", **kw)
  flags.DEFINE_integer("data_parallel_size", None, "dp groups, each a whole copy of the model on its own tp devices "
                       "with its own KV pages; requests go to the least-loaded group. Default 1.", **kw)
  flags.DEFINE_string("mesh", None, "The device mesh as one spec, e.g. 'dp=2,tp=4' (instead of "
                      "--tensor_parallel_size / --data_parallel_size).", **kw)
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0 for jax.distributed (multi-host).", **kw)
  flags.DEFINE_integer("num_processes", None, "Processes (hosts) of a multi-host run.", **kw)
  flags.DEFINE_integer("process_id", None, "This process's index in a multi-host run (0 serves HTTP).", **kw)
  flags.DEFINE_bool("multihost", False, "Join a multi-host run whose coordinator jax.distributed discovers itself "
                    "(TPU pod slices, SLURM, Open MPI); the three flags above override what it finds.", **kw)


def _flag(name):
  from absl import flags
  return (_FLAG_VALUES if _FLAG_VALUES is not None else flags.FLAGS)[name].value


def mesh_shape_from_flags():
  """--mesh, or --data_parallel_size/--tensor_parallel_size, as a sharding.MeshShape; None when none is given
  (one device, no mesh). Contradicting flags are refused."""
  from recguide_jax.parallel import sharding
  spec, tp, dp = _flag("mesh"), _flag("tensor_parallel_size"), _flag("data_parallel_size")
  if spec:
    shape = sharding.parse_mesh(spec)
    if (tp is not None and tp != shape.tp) or (dp is not None and dp != shape.dp):
      raise sharding.MeshError(f"--mesh {spec!r} contradicts --tensor_parallel_size {tp} / --data_parallel_size {dp}; "
                                 "pass one of them")
    return shape
  if tp is None and dp is None:
    return None
  for name, v in (("--tensor_parallel_size", tp), ("--data_parallel_size", dp)):
    if v is not None and v < 1:
      raise sharding.MeshError(f"{name} must be >= 1, got {v}")
  return sharding.MeshShape(dp=dp or 1, tp=tp or 1)


def mesh_from_flags():
  """The jax Mesh the flags ask for over every process's devices, or None (one device)."""
  from recguide_jax.parallel import sharding
  shape = mesh_shape_from_flags()
  return None if shape is None else sharding.make_mesh(shape)


def simulate_cpu_devices(count: int) -> None:
  """Runs on `count` simulated CPU devices (XLA's host-platform device count): a mesh to test sharded programs
  without accelerators. Call before jax initializes its backends (before the first computation)."""
  import os
  if count:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={count}").strip()
    import jax
    jax.config.update("jax_platforms", "cpu")


def initialize_from_flags() -> bool:
  """Calls `jax.distributed.initialize` when the flags ask for a multi-host run (before any other jax call);
  returns whether it did."""
  address, n, pid, auto = (_flag("coordinator_address"), _flag("num_processes"), _flag("process_id"),
                           _flag("multihost"))
  if not (address or n or pid is not None or auto):
    return False
  if not auto and (address is None or n is None or pid is None):
    raise ValueError("a multi-host run needs --coordinator_address, --num_processes and --process_id together "
                     "(or --multihost to let jax.distributed discover them)")
  if n is not None and not (n >= 1 and pid is not None and 0 <= pid < n):
    raise ValueError(f"--process_id must lie in [0, --num_processes {n}), got {pid}")
  initialize(address, n, pid)
  return True


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
  import jax
  kwargs = {k: v for k, v in dict(coordinator_address=coordinator_address, num_processes=num_processes,
                                  process_id=process_id).items() if v is not None}
  jax.distributed.initialize(**kwargs)


def is_leader() -> bool:
  import jax
  return jax.process_index() == 0


def process_count() -> int:
  import jax
  return jax.process_count()


# ---- leader / follower ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OutputRef:
  """An argument that is output `index` of the step published as number `step` (every process holds its own)."""
  step: int
  index: int


STOP = "stop"


def _client():
  from jax._src import distributed as dist
  client = dist.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialized (initialize_from_flags / initialize first)")
  return client


class Leader:
  """Installed on the leader's runner: publishes every step before running it and remembers the device outputs a
  later step may take as an argument (by identity)."""

  def __init__(self, runner, client=None):
    if hasattr(runner, "runners"):  # data_parallel.ReplicaRunners: each group's engine calls its own runner
      raise ValueError("a multi-host run serves one group spanning the hosts (--data_parallel_size 1); for data "
                       "parallelism over hosts run one server per group behind a load balancer")
    self.runner = runner
    self.client = client or _client()
    self.step = 0
    self._lock = threading.Lock()
    self._outputs: dict[int, tuple[int, int, Any]] = {}  # id(array) -> (step, index, array kept alive)
    self._execute = runner.execute
    runner.before_execute = None  # published by `execute` below, which knows the step number of the outputs
    runner.execute = self.execute

  def execute(self, key, inputs):
    import jax
    with self._lock:  # one step at a time in publication order (dp groups step from threads)
      n = self.step
      args = jax.tree.map(self._ref, inputs)
      self.client.key_value_set_bytes(f"{STEP_PREFIX}/{n}", pickle.dumps((key, args)))
      if n >= KEEP_STEPS:
        self.client.key_value_delete(f"{STEP_PREFIX}/{n - KEEP_STEPS}")
      self.step += 1
      outs = self._execute(key, inputs)
      self._outputs = {k: v for k, v in self._outputs.items() if v[0] > n - OUTPUT_WINDOW}
      for i, out in enumerate(outs):
        if isinstance(out, jax.Array):
          self._outputs[id(out)] = (n, i, out)
      return outs

  def _ref(self, arg):
    import jax
    import numpy as np
    if isinstance(arg, jax.Array):
      if id(arg) not in self._outputs:
        raise ValueError(f"a device array passed to a step must be an output of one of the last {OUTPUT_WINDOW} "
                         f"steps (followers hold only those)")
      n, i, _ = self._outputs[id(arg)]
      return OutputRef(n, i)
    return np.asarray(arg)

  def stop(self) -> None:
    """Tells the followers to return from `follow`."""
    with self._lock:
      self.client.key_value_set_bytes(f"{STEP_PREFIX}/{self.step}", pickle.dumps(STOP))
      self.step += 1


def lead(runner) -> Leader:
  """Makes this process the leader of `runner`'s steps (call on process 0, before the first step)."""
  return Leader(runner)


def follow(runner, timeout_s: float = 24 * 3600.0, client=None) -> int:
  """Runs every step the leader publishes, in order, until it stops; returns the number of steps run."""
  import jax
  client = client or _client()
  # the leader publishes a call once it can run it: a variant this process lacks is compiled here, in line
  runner.defer_unplanned = False
  outputs: dict[int, tuple] = {}
  n = 0
  while True:
    msg = pickle.loads(client.blocking_key_value_get_bytes(f"{STEP_PREFIX}/{n}", int(timeout_s * 1000)))
    if msg == STOP:
      return n
    key, args = msg
    args = jax.tree.map(lambda a: outputs[a.step][a.index] if isinstance(a, OutputRef) else a, args)
    outputs[n] = runner.execute(key, args)
    outputs.pop(n - OUTPUT_WINDOW, None)
    n += 1
