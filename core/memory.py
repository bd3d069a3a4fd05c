"""How much memory the devices of this process have, for checks made before compiling.

  device_memory(device)  the pool a device allocates from: a GPU's (or TPU's) allocator limit
                         (`device.memory_stats()["bytes_limit"]`, what XLA can hand out after
                         XLA_PYTHON_CLIENT_MEM_FRACTION), or on the CPU the host's available
                         RAM, which every simulated CPU device of the process shares
  per_device_budget      one device's share of that pool, less a headroom fraction
  available_ram          /proc/meminfo MemAvailable, else os.sysconf's available pages
  format_bytes           "12.3 GiB"
"""

from __future__ import annotations

import dataclasses
import os

# Share of a GPU's bytes_limit kept out of a budget for what the budget does not count
# (XLA's temporaries, the dense model and its optimizer state, activations).
GPU_HEADROOM = 0.2


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
  """A memory pool and the devices of this process that allocate from it."""

  bytes: int      # size of the pool
  devices: int    # devices sharing it (1 for a GPU; every local device for the CPU)
  source: str     # what the number is, for messages
  host_ram: bool = False  # the host's RAM (CPU devices), not a device's own memory

  @property
  def per_device(self) -> int:
    return self.bytes // max(self.devices, 1)


def available_ram() -> int | None:
  """Bytes of RAM the host can give a new allocation without swapping: MemAvailable of
  /proc/meminfo (free pages plus reclaimable caches), else free pages from os.sysconf
  (which leave the caches out, so less), or None when neither is readable."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def device_memory(device=None) -> DeviceMemory | None:
  """The pool `device` (default: the first local device) allocates from, or None when its
  size is unknown (a backend without memory stats, a host without /proc/meminfo)."""
  import jax
  device = jax.local_devices()[0] if device is None else device
  try:
    stats = device.memory_stats() or {}
  except Exception:  # backends without stats raise (e.g. "not implemented")
    stats = {}
  if "bytes_limit" in stats:
    return DeviceMemory(int(stats["bytes_limit"]), 1, f"{device.device_kind} bytes_limit")
  if device.platform == "cpu":
    ram = available_ram()
    if ram is None:
      return None
    n = sum(d.platform == "cpu" for d in jax.local_devices())
    return DeviceMemory(ram, n, "available RAM" + (f" shared by {n} CPU devices" if n > 1
                                                   else ""), host_ram=True)
  return None


def per_device_budget(mem: DeviceMemory, headroom: float = GPU_HEADROOM) -> int:
  """One device's share of `mem`: a GPU's bytes_limit less `headroom` of it; on the CPU
  the available RAM divided over the devices sharing it (available RAM already leaves out
  what the process and the rest of the host hold)."""
  if mem.host_ram:
    return mem.per_device
  return int(mem.bytes * (1.0 - headroom))


def format_bytes(n: float) -> str:
  """n bytes in the largest binary unit that keeps the number at or above 1."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(round(n, 0 if unit == "B" else 1)) < 1024:   # as printed: never "1024.0 KiB"
      return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:,.1f} TiB"
