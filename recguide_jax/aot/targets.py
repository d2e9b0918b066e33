"""The accelerators a step can be compiled for from this host, with the figures their vendors publish.

A TPU target is a libtpu topology (`jax.experimental.topologies.get_topology_desc(platform="tpu", ...)`); a GPU
target is an XLA:GPU `GpuTargetConfigProto` (SM count, compute capability, shared memory, bandwidth, memory), so
XLA:GPU and the Triton kernels compile for it without a GPU. Either gives compile-only devices: a mesh over them
lowers and compiles every variant exactly as on the machine, and `memory_analysis()` is per device.

`prepare_environment()` must run before jax initialises a backend: it keeps libtpu from asking a cloud metadata
server for the (absent) TPU's description and the CUDA plugin from probing a driver that is not there.
"""

from __future__ import annotations

import dataclasses
import enum
import os

GIB = 2 ** 30


class Platform(str, enum.Enum):
  TPU = "tpu"
  GPU = "cuda"


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip: its memory per device and what the compiler needs to target it."""
  name: str
  platform: Platform
  description: str
  memory_bytes: int  # HBM per device, as the vendor publishes it
  tpu_version: str = ""  # libtpu's topology prefix ("v5e")
  gpu_info: str = ""  # the GpuTargetConfigProto's gpu_device_info fields (text format)
  dnn_version: tuple[int, int, int] = (9, 8, 0)

  def gpu_target_config(self) -> str:
    """The `GpuTargetConfigProto` (text format) jax's deviceless GPU topology takes."""
    major, minor, patch = self.dnn_version
    return (f"gpu_device_info {{ {self.gpu_info} device_memory_size: {self.memory_bytes} }}\n"
            f'platform_name: "CUDA"\n'
            f"dnn_version_info {{ major: {major} minor: {minor} patch: {patch} }}\n"
            f"runtime_version {{ major: 12 minor: 8 patch: 0 }}\n"
            f'device_description_str: "{self.description}"\n')


def _gpu_info(sms: int, cc_major: int, bandwidth: int, l2_bytes: int, clock_ghz: float) -> str:
  # Hopper and Blackwell share the SM limits below (228 KB shared memory per SM, 227 KB per block opt-in)
  return (f"threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
          f"shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: {sms} fpus_per_core: 128 "
          f"block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535 "
          f"memory_bandwidth: {bandwidth} l2_cache_size: {l2_bytes} clock_rate_ghz: {clock_ghz} "
          f"shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: {cc_major} minor: 0 }} "
          f"registers_per_core_limit: 65536 registers_per_block_limit: 65536")


CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("v5e", Platform.TPU, "TPU v5e", 16 * GIB, tpu_version="v5e"),
    Chip("v6e", Platform.TPU, "TPU v6e (Trillium)", 32 * GIB, tpu_version="v6e"),
    Chip("v5p", Platform.TPU, "TPU v5p", 95 * GIB, tpu_version="v5p"),
    Chip("h100", Platform.GPU, "NVIDIA H100 80GB HBM3", 80 * GIB,
         gpu_info=_gpu_info(132, 9, 3_352_000_000_000, 50 * 2 ** 20, 1.98)),
    Chip("h200", Platform.GPU, "NVIDIA H200 141GB HBM3e", 141 * GIB,
         gpu_info=_gpu_info(132, 9, 4_800_000_000_000, 50 * 2 ** 20, 1.98)),
    Chip("b200", Platform.GPU, "NVIDIA B200", 180 * GIB, gpu_info=_gpu_info(148, 10, 7_700_000_000_000,
                                                                             126 * 2 ** 20, 1.965)),
)}


@dataclasses.dataclass(frozen=True)
class Target:
  """A chip and how many of them: `v5e:2x2` (a TPU slice by its topology), `h100:2` (GPUs on one host)."""
  chip: Chip
  shape: tuple[int, ...]  # TPU: the slice's chip grid (2 or 3 dims); GPU: (count,)

  @property
  def num_devices(self) -> int:
    n = 1
    for s in self.shape:
      n *= s
    return n

  @property
  def platform(self) -> Platform:
    return self.chip.platform

  @property
  def name(self) -> str:
    return f"{self.chip.name}:{'x'.join(map(str, self.shape))}"

  def devices(self) -> list:
    """The target's compile-only jax devices (call `prepare_environment()` first)."""
    from jax.experimental import topologies
    if self.platform is Platform.TPU:
      grid = self.shape + (1,) * (3 - len(self.shape))
      # v5e / v6e hosts hold up to 8 chips (a slice of <= 8 is one host); v5p hosts a 2x2x1 block
      hosts = grid if len(self.shape) == 2 and self.num_devices <= 8 else (min(grid[0], 2), min(grid[1], 2), 1)
      topo = topologies.get_topology_desc(platform="tpu", topology_name=f"{self.chip.tpu_version}:"
                                          f"{'x'.join(map(str, self.shape))}", chip_config_name="default",
                                          chips_per_host_bounds=hosts, num_slices=1)
    else:
      topo = topologies.get_topology_desc(platform="cuda", target_config=self.chip.gpu_target_config(),
                                          topology=f"1x1x{self.num_devices}")
    return list(topo.devices)


def parse_target(spec: str) -> Target:
  """'v5e:2x2', 'v6e:1x1', 'v5p:2x2x1', 'h200', 'h100:2' -> Target; a ValueError names the known chips."""
  name, _, shape = spec.strip().lower().partition(":")
  chip = CHIPS.get(name)
  if chip is None:
    raise ValueError(f"--target: unknown chip {name!r} in {spec!r}; known: {', '.join(CHIPS)}")
  try:
    dims = tuple(int(s) for s in shape.split("x")) if shape else (1,) * (2 if chip.platform is Platform.TPU else 1)
  except ValueError:
    raise ValueError(f"--target {spec!r}: expected CHIP:AxB (TPU) or CHIP:N (GPU)") from None
  if not dims or min(dims) < 1 or (chip.platform is Platform.GPU and len(dims) != 1) or len(dims) > 3:
    raise ValueError(f"--target {spec!r}: expected CHIP:AxB[xC] for a TPU slice or CHIP:N for N GPUs")
  return Target(chip, dims)


def prepare_environment() -> None:
  """Before jax starts a backend: compile-only use of libtpu and of the CUDA plugin on a host without either chip.
  Backends stay on the CPU (the targets' devices come from their topologies, not from a backend)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server to ask
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no chip for two processes to contend for
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # its CUDA version probe calls cuInit
  os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")


def missing_compiler(platform: Platform) -> str | None:
  """Why this install cannot compile for `platform` (None: it can): libtpu or jax's CUDA plugin absent."""
  import importlib.util
  if platform is Platform.TPU:
    return None if importlib.util.find_spec("libtpu") else (
        "libtpu is not installed (pip install 'jax[tpu]'; it runs on a CPU host as a compiler)")
  import importlib.metadata
  plugins = {ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")}
  return None if any("cuda" in p for p in plugins) else (
      "jax's CUDA plugin is not installed (pip install -e '.[cuda]'; it compiles for a GPU without one)")
