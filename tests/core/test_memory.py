"""core.memory: the device's memory pool, read from the backend or the host."""

from __future__ import annotations

import jax

from core import memory


class _Dev:
  """A device stand-in with the attributes device_memory reads."""

  def __init__(self, platform, stats, kind="fake"):
    self.platform, self._stats, self.device_kind = platform, stats, kind

  def memory_stats(self):
    if isinstance(self._stats, Exception):
      raise self._stats
    return self._stats


def test_available_ram_reads_meminfo_memavailable():
  with open("/proc/meminfo") as f:
    line = next(l for l in f if l.startswith("MemAvailable:"))
  kb = int(line.split()[1])
  got = memory.available_ram()
  # The host's free memory moves between the two reads; 10% of it is far more than it moves.
  assert abs(got - kb * 1024) <= 0.1 * kb * 1024


def test_available_ram_falls_back_to_sysconf(monkeypatch):
  real_open = open

  def no_meminfo(path, *a, **kw):
    if path == "/proc/meminfo":
      raise FileNotFoundError(path)
    return real_open(path, *a, **kw)

  monkeypatch.setattr("builtins.open", no_meminfo)
  monkeypatch.setattr(memory.os, "sysconf",
                      lambda n: {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}[n])
  assert memory.available_ram() == 4096 * 1000


def test_gpu_pool_is_bytes_limit_with_headroom():
  mem = memory.device_memory(_Dev("gpu", {"bytes_limit": 80 << 30, "bytes_in_use": 5},
                                  "NVIDIA H100"))
  assert (mem.bytes, mem.devices, mem.host_ram) == (80 << 30, 1, False)
  assert "bytes_limit" in mem.source and "H100" in mem.source
  assert memory.per_device_budget(mem) == int((80 << 30) * (1 - memory.GPU_HEADROOM))
  assert memory.per_device_budget(mem, headroom=0.5) == 40 << 30


def test_cpu_pool_is_available_ram_shared_by_the_local_devices(monkeypatch):
  monkeypatch.setattr(memory, "available_ram", lambda: 64 << 30)
  n = len(jax.local_devices())
  mem = memory.device_memory(_Dev("cpu", RuntimeError("no stats")))
  assert (mem.bytes, mem.devices, mem.host_ram) == (64 << 30, n, True)
  assert "available RAM" in mem.source
  assert memory.per_device_budget(mem) == (64 << 30) // n   # no headroom on the host's RAM


def test_unknown_pool_is_none(monkeypatch):
  monkeypatch.setattr(memory, "available_ram", lambda: None)
  assert memory.device_memory(_Dev("cpu", {})) is None
  assert memory.device_memory(_Dev("tpu", {})) is None


def test_the_real_first_device_has_a_pool():
  mem = memory.device_memory()
  assert mem is not None and mem.bytes > 0 and mem.per_device > 0


def test_format_bytes():
  assert memory.format_bytes(512) == "512 B"
  assert memory.format_bytes(1536) == "1.5 KiB"
  assert memory.format_bytes(3 << 30) == "3.0 GiB"
  assert memory.format_bytes(6 << 40) == "6.0 TiB"
  # Just under a unit prints as the next one, not as "1024.0" of this one.
  assert memory.format_bytes((1 << 20) - 1) == "1.0 MiB"
  assert memory.format_bytes((1 << 40) - 1) == "1.0 TiB"
  assert memory.format_bytes(1023) == "1023 B"
