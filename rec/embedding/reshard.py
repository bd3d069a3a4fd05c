"""Resharding: an embedding collection's state moved between any two physical layouts (device
count, mesh, sharding kinds, planner budget) through each table's unsharded row order.

A collection's `Layout` (saved with every checkpoint, `EmbeddingCollection.layout()`) says
where each table's shards sit in the group buffers: per group its storage, stored width,
buffer rows and device blocks, and per shard (table, rows, columns, first buffer row). With
it, a checkpoint's arrays (read on the host in the layout they were written in) become
logical tables and then the buffers of another layout:

  logical = to_logical(saved_layout, host_state)         # {table: {columns: Chunk}}
  host = from_logical(new_layout, logical, storages, templates, step)

A `Chunk` is one column chunk of a table in unsharded row order: its storage's per-row
arrays (`RowStorage.to_rows`: rows, or codes + scale + bias + a cache's residency and
counters) and the sparse optimizer's per-row state. Tables keep their chunks where the new
plan chunks them alike (every kind but cw has one chunk, the whole row; cw with the same
chunk count keeps its chunks) in the same storage (its tier aside: a table moved to or from
the host tier, `...@host`, keeps its arrays): then rows and state move bit for bit, and a
cache keeps every row it held when its new sets have room (a new block's cache may be
smaller or its sets other; rows without room are written back quantized, as an eviction
does). A table moved between fp32 and the host tier's fp32_cache goes through its float32
values, exact (its cache starts empty). A chunk
the new plan cuts otherwise (cw over another chunk count), or a table given another
storage, goes through float32 values: float rows exact, quantized rows requantized (round
to nearest); per-element optimizer state (Adagrad, Adam) is concatenated and cut exactly;
a per-row optimizer array (row-wise Adagrad's mean of squared gradients over the stored
row) is spread evenly over its chunk's columns and averaged over the new chunk, exact (up
to rounding) where whole chunks merge, an approximation where one splits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from rec.embedding import storage as storage_lib
from rec.embedding import storage_spec


class LayoutMismatchError(ValueError):
  """A checkpoint's tables differ from those of the collection built now (rows or dim)."""


@dataclasses.dataclass(frozen=True)
class Span:
  """One shard of a table in a group buffer: its rows and columns, and the buffer row its
  first row sits at."""

  table: str
  row_start: int
  row_end: int
  col_start: int
  col_end: int
  buffer_row: int


@dataclasses.dataclass(frozen=True)
class GroupLayout:
  """A group's buffer: storage (its spec's text), stored row width, rows (all blocks) and
  blocks (one per device; 1: replicated), and where its tables' shards are."""

  storage: str
  width: int
  rows: int
  blocks: int
  spans: tuple[Span, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where every table's rows are in a collection's state, and what placed them (devices,
  mesh, each table's sharding kind)."""

  devices: int
  mesh: tuple[tuple[str, int], ...]
  kinds: tuple[tuple[str, str], ...]            # (table, sharding kind), in table order
  tables: tuple[tuple[str, int, int], ...]      # (table, rows, dim), in table order
  groups: tuple[tuple[str, GroupLayout], ...]

  def to_json(self) -> dict[str, Any]:
    return {"devices": self.devices, "mesh": [list(m) for m in self.mesh],
            "kinds": [list(k) for k in self.kinds], "tables": [list(t) for t in self.tables],
            "groups": {name: {"storage": g.storage, "width": g.width, "rows": g.rows,
                              "blocks": g.blocks,
                              "spans": [list(dataclasses.astuple(s)) for s in g.spans]}
                       for name, g in self.groups}}

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> Layout:
    return cls(int(d["devices"]), tuple((str(a), int(n)) for a, n in d["mesh"]),
               tuple((str(t), str(k)) for t, k in d["kinds"]),
               tuple((str(t), int(r), int(c)) for t, r, c in d["tables"]),
               tuple((name, GroupLayout(g["storage"], int(g["width"]), int(g["rows"]),
                                        int(g["blocks"]),
                                        tuple(Span(str(s[0]), *map(int, s[1:]))
                                              for s in g["spans"])))
                     for name, g in d["groups"].items()))

  def describe(self) -> str:
    """'8 devices tw', '8 devices (data:2,model:4) rw', '4 devices 20 tw + 6 rw'."""
    counts: dict[str, int] = {}
    for _, k in self.kinds:
      counts[k] = counts.get(k, 0) + 1
    kinds = (next(iter(counts)) if len(counts) == 1 else
             " + ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda x: -x[1])))
    mesh = "" if len(self.mesh) <= 1 else " (" + ",".join(f"{a}:{n}" for a, n in self.mesh) + ")"
    return f"{self.devices} device{'s' if self.devices != 1 else ''}{mesh} {kinds}"

  def same_buffers(self, other: Layout) -> bool:
    """Whether both layouts hold the same group buffers with the same rows in them (they
    may differ in mesh or kinds' names: 8 devices as data:8 or data:2,model:4)."""
    return self.tables == other.tables and self.groups == other.groups

  def check_tables(self, now: Layout, where: str) -> None:
    """Raises LayoutMismatchError (one line, naming the table and both shapes) when a
    table of `now` has other rows or dim here, or one layout has a table the other lacks."""
    then = {t: (r, d) for t, r, d in self.tables}
    names = [t for t, _, _ in now.tables]
    extra = [t for t in then if t not in names]
    if extra:
      raise LayoutMismatchError(
          f"{where}: holds table {extra[0]!r}, which the model built now lacks (its tables: "
          f"{', '.join(names)}); expected the tables the checkpoint was written with")
    for t, r, d in now.tables:
      if t not in then:
        raise LayoutMismatchError(
            f"{where}: holds no table {t!r} (its tables: {', '.join(then)}); expected the "
            f"tables of the model built now")
      if then[t] != (r, d):
        raise LayoutMismatchError(
            f"{where}: table {t} is [{then[t][0]}, {then[t][1]}] (rows, dim) there and "
            f"[{r}, {d}] in the model built now; expected the same table sizes (--num_rows, "
            "the data's vocabulary) and embedding dim")


@dataclasses.dataclass
class Chunk:
  """Columns [cols) of a table, in unsharded row order: the storage's per-row arrays
  (`RowStorage.to_rows`) and the optimizer's per-row state, each with leading dim the
  table's rows and rows stored `width` wide (pad columns after the real ones)."""

  cols: tuple[int, int]
  width: int
  storage: str
  table: dict[str, np.ndarray]
  opt: dict[str, np.ndarray]


Logical = dict[str, dict[tuple[int, int], Chunk]]


def _storage(spec: str) -> storage_lib.RowStorage:
  return storage_spec.make_storage(storage_spec.StorageSpec.parse(spec))


def _same_rows(a: str, b: str) -> bool:
  """Whether storages `a` and `b` (specs' text) keep the same per-row arrays: the same spec
  but for its tier (the host tier holds the arrays in host memory, in the same form)."""
  if a == b:
    return True
  sa, sb = (storage_spec.StorageSpec.parse(x) for x in (a, b))
  return dataclasses.replace(sa, tier="device") == dataclasses.replace(sb, tier="device")


def to_logical(layout: Layout, state: Mapping[str, Any]) -> Logical:
  """Each table's chunks in unsharded row order from a collection state (host arrays) laid
  out as `layout` says."""
  rows_of = {t: r for t, r, _ in layout.tables}
  out: Logical = {t: {} for t in rows_of}
  covered: dict[tuple[str, tuple[int, int]], int] = {}
  for name, g in layout.groups:
    st = _storage(g.storage).to_rows(state[name]["table"], g.blocks)
    opt = {k: np.asarray(v) for k, v in state[name]["opt"].items()}
    for s in g.spans:
      cols = (s.col_start, s.col_end)
      ch = out[s.table].get(cols)
      if ch is None:
        n = rows_of[s.table]
        ch = out[s.table][cols] = Chunk(
            cols, g.width, g.storage,
            {k: np.zeros((n,) + v.shape[1:], v.dtype) for k, v in st.items()},
            {k: np.zeros((n,) + v.shape[1:], v.dtype) for k, v in opt.items()})
      n = s.row_end - s.row_start
      for dst, src in ((ch.table, st), (ch.opt, opt)):
        for k, v in src.items():
          dst[k][s.row_start:s.row_end] = v[s.buffer_row:s.buffer_row + n]
      key = (s.table, cols)
      covered[key] = covered.get(key, 0) + n
  short = [(t, c, n) for (t, c), n in covered.items() if n != rows_of[t]]
  if short:
    t, c, n = short[0]
    raise ValueError(f"layout: table {t!r} columns {c}: its shards cover {n} of "
                     f"{rows_of[t]} rows; expected every row once")
  return out


def _rechunk(chunks: Mapping[tuple[int, int], Chunk], cols: tuple[int, int], width: int,
             spec: str, storage: storage_lib.RowStorage, opt_keys: Mapping[str, int],
             table: str) -> Chunk:
  """Columns `cols` of a table stored `width` wide in `storage`, from its chunks in another
  cut or storage (module docstring). `opt_keys`: the optimizer's arrays and their ndim.
  Per-element optimizer arrays come back with the real columns only."""
  old = sorted(chunks.values(), key=lambda c: c.cols)
  dim = old[-1].cols[1]
  n = next(iter(old[0].table.values())).shape[0]
  values = np.zeros((n, dim), np.float32)
  for ch in old:
    c0, c1 = ch.cols
    values[:, c0:c1] = _storage(ch.storage).rows_to_float(ch.table)[:, :c1 - c0]
  c0, c1 = cols
  new_values = np.zeros((n, width), np.float32)
  new_values[:, :c1 - c0] = values[:, c0:c1]
  overlap = [ch for ch in old if ch.cols[0] < c1 and c0 < ch.cols[1]]
  tbl = storage.rows_from_float(new_values, like=tuple(ch.table for ch in overlap))
  opt = {}
  for k, ndim in opt_keys.items():
    missing = [ch.cols for ch in old if k not in ch.opt]
    if missing:
      raise ValueError(f"table {table!r}: the checkpoint's optimizer state has no {k!r} "
                       "(another sparse optimizer); expected the optimizer it was written with")
    if ndim == 2:      # per element: concatenated, then cut
      full = np.zeros((n, dim), np.float32)
      for ch in old:
        full[:, ch.cols[0]:ch.cols[1]] = ch.opt[k][:, :ch.cols[1] - ch.cols[0]]
      opt[k] = full[:, c0:c1]
    else:              # per row, a mean over the stored row: spread over columns, averaged
      acc = np.zeros(n, np.float64)
      for ch in overlap:
        per_col = ch.opt[k].astype(np.float64) * ch.width / (ch.cols[1] - ch.cols[0])
        acc += per_col * (min(c1, ch.cols[1]) - max(c0, ch.cols[0]))
      opt[k] = (acc / width).astype(old[0].opt[k].dtype)
  return Chunk(cols, width, spec, tbl, opt)


def from_logical(layout: Layout, logical: Logical,
                 storages: Mapping[str, storage_lib.RowStorage],
                 templates: Mapping[str, Any], step: int) -> dict[str, Any]:
  """The collection state (host arrays) of `layout` holding the tables of `logical`.
  `storages`: each group's storage; `templates`: each group's fresh state (host arrays:
  what padding rows and columns hold); `step`: the train step (a cache's overflow is
  written back with stochastic rounding seeded by it)."""
  out = {}
  for name, g in layout.groups:
    storage = storages[name]
    tmpl = templates[name]
    rows = {k: np.array(v) for k, v in storage.to_rows(tmpl["table"], g.blocks).items()}
    opt = {k: np.array(v) for k, v in tmpl["opt"].items()}
    made: dict[tuple[str, tuple[int, int]], Chunk] = {}
    for s in g.spans:
      cols = (s.col_start, s.col_end)
      have = logical[s.table]
      ch = have.get(cols)
      exact = (ch is not None and ch.width == g.width and _same_rows(ch.storage, g.storage)
               and set(ch.table) == set(rows) and set(ch.opt) == set(opt))
      if not exact:
        ch = made.get((s.table, cols))
        if ch is None:
          ch = made[(s.table, cols)] = _rechunk(
              have, cols, g.width, g.storage, storage, {k: v.ndim for k, v in opt.items()},
              s.table)
      n, b = s.row_end - s.row_start, s.buffer_row
      for k in rows:
        rows[k][b:b + n] = ch.table[k][s.row_start:s.row_end]
      for k in opt:
        v = ch.opt[k][s.row_start:s.row_end]
        if exact or v.ndim == 1:
          opt[k][b:b + n] = v
        else:           # real columns only; the pad columns keep their initial values
          opt[k][b:b + n, :v.shape[1]] = v
    out[name] = {"table": storage.from_rows(rows, g.blocks, step), "opt": opt}
  return out
