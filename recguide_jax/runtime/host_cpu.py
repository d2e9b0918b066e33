"""What the host CPU offers that an engine choice depends on (the size of its last-level cache, Linux sysfs) and what
benchmarks record of it (its model name: CPU figures of two runs compare only on the same model)."""

from __future__ import annotations

import functools
import pathlib
import platform

_CACHES = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@functools.cache
def last_level_cache_bytes() -> int | None:
  """Bytes of the largest data or unified cache level of CPU 0, or None where the platform does not say."""
  best_level, best_size = -1, None
  for index in sorted(_CACHES.glob("index*")):
    try:
      if (index / "type").read_text().strip() == "Instruction":
        continue
      level = int((index / "level").read_text())
      text = (index / "size").read_text().strip()
      size = int(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else int(text)
    except (OSError, ValueError):
      continue
    if level > best_level:
      best_level, best_size = level, size
  return best_size


@functools.cache
def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
  """The CPU's model name (`cpuinfo` on Linux, else what `platform` says; "unknown" where neither does)."""
  try:
    for line in pathlib.Path(cpuinfo).read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine() or "unknown"
