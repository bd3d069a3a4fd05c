"""Embedding row storage as a typed setting (`StorageSpec`), and the registry from a spec
to its `RowStorage`.

One grammar (`StorageSpec.parse`; flags, table configs and study lists all read it):
  fp32 | bf16 | bf16_sr                         float rows (rec/embedding/storage.py)
  int8 | int4 | int2                            FBGEMM row-wise codes, no cache
  int8_cache[:lfu|lru[:fraction[:ways]]]        the same with an fp32 cache of the hot rows
  int4_cache[...] | int2_cache[...]             (rec/embedding/rowwise_storage.py, arXiv
                                                2010.11305)
  fp32_cache[...]                               float32 rows behind the same cache
  <a *_cache spec>@host                         its rows (and the table's optimizer state)
                                                in host memory, the cache on the device
                                                (the host tier, rec/embedding/host_tier.py)
Cache defaults: LFU, the paper's fraction (int8 / fp32 5%, int4 / int2 1%), 16 ways. One
validation (`_check`, with the cache settings' `rowwise_storage.check_cache`, which the
storage itself uses too) serves every way in (the constructor, `parse`, `from_flags`), its
messages naming the setting as the caller knows it (a flag, a table, a list entry).

A spec is parsed once where a setting enters (a flag, a TableConfig, a study's list) and
travels as the object: frozen and hashable, so it is a static argument under jit and part
of the collection's group keys. `str(spec)` is its canonical text ("int8_cache:lfu:0.05";
ways only when not the default), which results.json and the group keys hold, and
`parse(str(spec)) == spec`. A run config holds the spec itself (`RecRunConfig.embedding.
storage`); its saved settings (what a checkpoint compares on resume) keep the flags' own
strings and numbers (`RecRunConfig.run_settings`: storage, cache_policy, cache_fraction).

The registry (`register_storage`, `make_storage`) maps a kind to the storage class that
implements it; it sits above storage.py and rowwise_storage.py, which never import it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rec.embedding import rowwise_storage
from rec.embedding import storage as storage_lib

TIERS = ("device", "host")   # where a table's rows live ("@host": the host tier)

# kind -> (make(spec, seed) -> RowStorage, default cache settings; None: no cache)
_REGISTRY: dict[str, tuple[Callable[[StorageSpec, int], storage_lib.RowStorage],
                           dict[str, object] | None]] = {}


def register_storage(kind: str, make: Callable[[StorageSpec, int], storage_lib.RowStorage],
                     cache_defaults: dict[str, object] | None = None) -> None:
  """Adds a storage kind: `make(spec, seed)` builds its storage. A kind with a cache gives
  `cache_defaults` ({cache_policy, cache_fraction, cache_ways}) and takes the
  `:policy:fraction:ways` suffix."""
  if not kind or ":" in kind:
    raise ValueError(f"register_storage: kind {kind!r}, expected a non-empty name without ':'")
  if cache_defaults is not None and set(cache_defaults) != set(_CACHE_FIELDS):
    raise ValueError(f"register_storage({kind!r}): cache_defaults {cache_defaults}, expected "
                     f"the keys {_CACHE_FIELDS}")
  _REGISTRY[kind] = (make, cache_defaults)


_CACHE_FIELDS = ("cache_policy", "cache_fraction", "cache_ways")


def kinds() -> list[str]:
  """Every registered storage kind."""
  return list(_REGISTRY)


def _num(x: float) -> str:
  """The shortest text that reads back as exactly `x` ("0.05", "1")."""
  g = format(x, "g")
  return g if float(g) == x else repr(x)


def _has_cache(kind: str) -> bool:
  return _REGISTRY[kind][1] is not None


def _check(kind, policy, fraction, ways, name: Callable[[str, object], str],
           tier: str = "device") -> None:
  """The one validation of a storage setting; `name(field, value)` says where it came from."""
  if kind not in _REGISTRY:
    raise ValueError(f"{name('kind', kind)}: expected one of {kinds()} (a *_cache kind may "
                     "add :lfu|lru[:fraction[:ways]], and @host)")
  if tier not in TIERS:
    raise ValueError(f"{name('tier', tier)}: expected one of {list(TIERS)}")
  if tier == "host" and not _has_cache(kind):
    raise ValueError(f"{name('tier', tier)}: storage {kind!r} has no device cache; the host "
                     f"tier keeps the hot rows in one, so it needs a *_cache kind (e.g. "
                     f"{'fp32' if kind in ('fp32', 'bf16', 'bf16_sr') else kind}_cache:lfu:0.05@host)")
  if _has_cache(kind):
    rowwise_storage.check_cache(policy, fraction, ways, name)
    return
  for f, v in zip(_CACHE_FIELDS, (policy, fraction, ways)):
    if v is not None:
      raise ValueError(f"{name(f, v)}: storage {kind!r} has no cache; cache settings go with "
                       f"a *_cache kind")


@dataclasses.dataclass(frozen=True)
class StorageSpec:
  """How a table's rows are stored: a registered kind, and for a cached kind its cache
  policy, fraction of rows and ways (None for kinds without a cache), and its tier."""

  kind: str = "fp32"
  cache_policy: str | None = None
  cache_fraction: float | None = None
  cache_ways: int | None = None
  tier: str = "device"   # "host": the rows in host memory, the cache on the device

  def __post_init__(self):
    if self.kind in _REGISTRY and _has_cache(self.kind):
      for f, default in _REGISTRY[self.kind][1].items():   # unset: the storage's default
        if getattr(self, f) is None:
          object.__setattr__(self, f, default)
      if isinstance(self.cache_fraction, int) and not isinstance(self.cache_fraction, bool):
        object.__setattr__(self, "cache_fraction", float(self.cache_fraction))
    _check(self.kind, self.cache_policy, self.cache_fraction, self.cache_ways,
           lambda f, v: f"StorageSpec: {f}={v!r}", self.tier)

  @classmethod
  def parse(cls, text: str, where: str = "storage") -> StorageSpec:
    """The spec of `text` (module docstring's grammar); errors name `where` and the text."""
    if not isinstance(text, str):
      raise ValueError(f"{where}={text!r}: expected a storage name such as 'fp32' or "
                       "'int8_cache:lfu:0.05'")
    body, at, tier = text.partition("@")
    tier = tier if at else "device"
    parts = body.split(":")
    kind = parts[0]

    def name(field, value):
      return f"{where}={text!r}: " + {"kind": f"storage {value!r}",
                                      "cache_policy": f"cache policy {value!r}",
                                      "cache_fraction": f"cache fraction {value!r}",
                                      "cache_ways": f"ways {value!r}",
                                      "tier": f"tier {value!r}"}[field]

    if kind not in _REGISTRY or (len(parts) > 1 and not _has_cache(kind)) or len(parts) > 4:
      raise ValueError(f"{where}={text!r}: expected one of {kinds()}, a *_cache kind optionally "
                       "followed by :lfu|lru[:fraction[:ways]] and optionally @host (e.g. "
                       "int8_cache:lru:0.05, fp32_cache:lfu:0.05@host)")
    if not _has_cache(kind):
      _check(kind, None, None, None, name, tier)
      return cls(kind)
    policy = parts[1] if len(parts) > 1 else None
    try:
      fraction = float(parts[2]) if len(parts) > 2 else None
    except ValueError:
      raise ValueError(f"{name('cache_fraction', parts[2])}: not a number") from None
    try:
      ways = int(parts[3]) if len(parts) > 3 else None
    except ValueError:
      raise ValueError(f"{name('cache_ways', parts[3])}: not a number") from None
    defaults = cls(kind)
    policy = defaults.cache_policy if policy is None else policy
    fraction = defaults.cache_fraction if fraction is None else fraction
    ways = defaults.cache_ways if ways is None else ways
    _check(kind, policy, fraction, ways, name, tier)
    return cls(kind, policy, fraction, ways, tier)

  @classmethod
  def from_flags(cls, storage: str, cache_policy: str, cache_fraction: float) -> StorageSpec:
    """The spec of the flags --storage, --cache_policy and --cache_fraction; the cache flags
    are checked whatever the storage (a bad value is an error even where it is unused) and
    belong to the spec only for a *_cache storage."""
    flag = {"kind": "--storage", "cache_policy": "--cache_policy",
            "cache_fraction": "--cache_fraction", "cache_ways": "cache ways", "tier": "--storage"}
    text = storage
    name = lambda f, v: f"{flag[f]}={text if f == 'tier' else v!r}" + (
        f": tier {v!r}" if f == "tier" else "")
    rowwise_storage.check_cache(cache_policy, cache_fraction, rowwise_storage.DEFAULT_WAYS, name)
    storage, at, tier = storage.partition("@")
    tier = tier if at else "device"
    if storage not in _REGISTRY or (tier != "device" and not _has_cache(storage)):
      _check(storage, None, None, None, name, tier)
    if tier not in TIERS:
      _check(storage, cache_policy, cache_fraction, rowwise_storage.DEFAULT_WAYS, name, tier)
    if _has_cache(storage):
      return cls(storage, cache_policy, float(cache_fraction), tier=tier)
    return cls(storage)

  @property
  def cached(self) -> bool:
    """Whether rows have an fp32 cache."""
    return self.cache_fraction is not None

  @property
  def host(self) -> bool:
    """Whether the rows live in host memory (the host tier)."""
    return self.tier == "host"

  def on_host(self, cache_fraction: float | None = None) -> StorageSpec:
    """This storage with its rows in host memory: a *_cache kind keeps its cache (or takes
    `cache_fraction`); fp32 / bf16 / bf16_sr become fp32_cache, int8 / int4 / int2 their
    *_cache kind, with the kind's default cache (LFU) or `cache_fraction`."""
    kind = self.kind
    if not _has_cache(kind):
      kind = "fp32_cache" if kind in ("fp32", "bf16", "bf16_sr") else f"{kind}_cache"
      if kind not in _REGISTRY:
        raise ValueError(f"StorageSpec.on_host: storage {self.kind!r} has no cached kind")
      spec = StorageSpec(kind, cache_fraction=cache_fraction)
    else:
      spec = dataclasses.replace(self, cache_fraction=self.cache_fraction
                                 if cache_fraction is None else cache_fraction)
    return dataclasses.replace(spec, tier="host")

  def __str__(self) -> str:
    if not self.cached:
      return self.kind
    text = f"{self.kind}:{self.cache_policy}:{_num(self.cache_fraction)}"
    if self.cache_ways != rowwise_storage.DEFAULT_WAYS:
      text = f"{text}:{self.cache_ways}"
    return f"{text}@host" if self.host else text

  def __format__(self, fmt: str) -> str:
    return format(str(self), fmt)


def make_storage(spec: StorageSpec, seed: int = 0) -> storage_lib.RowStorage:
  """The storage of `spec`; `seed` seeds stochastic rounding."""
  if not isinstance(spec, StorageSpec):
    raise TypeError(f"make_storage: {spec!r} is a {type(spec).__name__}; expected a "
                    "StorageSpec (StorageSpec.parse reads a storage name)")
  return _REGISTRY[spec.kind][0](spec, seed)


register_storage("fp32", lambda s, seed: storage_lib.Fp32Storage())
register_storage("bf16", lambda s, seed: storage_lib.Bf16Storage())
register_storage("bf16_sr", lambda s, seed: storage_lib.Bf16Storage(rounding="stochastic",
                                                                    seed=seed))
register_storage("fp32_cache", lambda s, seed: rowwise_storage.CachedQuantizedStorage(
    bits=32, policy=s.cache_policy, fraction=s.cache_fraction, ways=s.cache_ways, seed=seed,
    host=s.host), cache_defaults={"cache_policy": "lfu",
                                  "cache_fraction": rowwise_storage.DEFAULT_FRACTION[32],
                                  "cache_ways": rowwise_storage.DEFAULT_WAYS})
for _bits in (8, 4, 2):
  register_storage(f"int{_bits}", lambda s, seed, b=_bits: rowwise_storage.CachedQuantizedStorage(
      bits=b, fraction=0.0, seed=seed))
  register_storage(f"int{_bits}_cache",
                   lambda s, seed, b=_bits: rowwise_storage.CachedQuantizedStorage(
                       bits=b, policy=s.cache_policy, fraction=s.cache_fraction,
                       ways=s.cache_ways, seed=seed, host=s.host),
                   cache_defaults={"cache_policy": "lfu",
                                   "cache_fraction": rowwise_storage.DEFAULT_FRACTION[_bits],
                                   "cache_ways": rowwise_storage.DEFAULT_WAYS})
