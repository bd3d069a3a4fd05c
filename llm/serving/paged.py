"""A paged KV cache (vLLM's PagedAttention, arXiv 2309.06180): one pool of fixed-size pages
per layer, a block table per request, pages handed out as a request grows and returned when
it finishes.

    pool = BlockPool(num_blocks)                    # host: which pages are free
    cache = PagedCache.init(cfg, num_blocks, block_size)
    layer = PagedLayer(cache.k[i], cache.v[i], tables_BM, lengths_B, slots_BT, "xla", cfg.dtype)
    x_BTD, layer = block(x_BTD, positions_BT, None, kv=layer)   # llm.model.Block
    cache = commit_pages(cache, slots_BT, new_k_per_layer, new_v_per_layer)

The pool is kv-head major, [G, N, P, K] (`kernels.paged_attention`). A request's cache is
compact: its token at position s sits in slot s, offset s % P of page table[s // P]. Page 0
is never handed out: it pads the tables of short and idle rows (their slots past the length
are masked, so its contents never matter). `PagedLayer` is what
`llm.model.Attention` calls when its `kv` has `write_and_attend`: it attends the call's
queries over the row's cached slots and the call's own keys and values, and hands those
back (`new_k`, `new_v`); `commit_pages`, a second jitted call that donates the pool, writes
them into their slots (`slots_BT`, flat indices into the pool; N*P for a padded token, which
the scatter drops). Reading and writing the pool in two programs is deliberate: XLA:CPU
copied every layer's whole pool when one program both read a pool and updated it in place
(SmolLM2, 30 layers: 10x slower steps), while a program that only updates it does so in
place. Attention:
  "xla"     gathers each row's pages into a contiguous [G, B, M*P, K] view, writes the call's
            keys and values into the view at their positions, and attends over it with the
            kernel's jnp reference (`kernels.paged_attention.attention_over_view`: products
            batched over (g, b), no transposed copy of the keys; on the 2-core CPU a third
            of the time the model's decode attention took over a [B, S, G, K] view);
  "pallas"  the Pallas kernel `kernels.paged_attention` over the cached slots, reading the
            pages through the table (no gathered copy), merged exactly (by log-sum-exp,
            `llm.attention.merge_partials`) with the call's tokens attending among
            themselves (the jnp reference: T x T keys);
  "auto"    "pallas" on a GPU, else "xla".
A call whose own tokens are a draft tree (`own_mask_BTT`: which of the call's keys each query
sees; `llm.serving.engine`'s speculative rounds) attends over the cached slots (the view or
the kernel, up to the row's start) and, separately, over the call's keys under that mask,
merged by log-sum-exp: tree nodes share positions, so they cannot be written into a view
by position. `PagedGroups` runs several groups of rows (decode rows and a prefill chunk) as
one call: the model sees their tokens flattened, each group attends as its own layer.

Letters: B rows, T tokens per row in this call, M pages per row (table width), N pages in the
pool, P slots per page, G key/value heads, K head dim, L layers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels.paged_attention import attention_over_view, gather_pages, paged_attention
from llm.attention import attention, merge_partials
from llm.config import LlamaConfig

PAGED_IMPLS = ("auto", "xla", "pallas")
NULL_BLOCK = 0


def choose_paged_impl(impl: str) -> str:
  if impl not in PAGED_IMPLS:
    raise ValueError(f"paged_attention={impl!r}: expected one of {PAGED_IMPLS}")
  if impl == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  return impl


class BlockPool:
  """Host-side free list of the pool's pages (page 0, the padding page, is never free)."""

  def __init__(self, num_blocks: int):
    if num_blocks < 2:
      raise ValueError(f"BlockPool: num_blocks={num_blocks}; expected >= 2 (page 0 pads tables)")
    self.num_blocks = num_blocks
    self._free = list(range(num_blocks - 1, 0, -1))    # pop() hands out low pages first
    self._used: set[int] = set()

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return len(self._used)

  def allocate(self, n: int) -> list[int] | None:
    """n free pages, or None (nothing taken) when fewer are free."""
    if n > len(self._free):
      return None
    out = [self._free.pop() for _ in range(n)]
    self._used.update(out)
    return out

  def free(self, blocks) -> None:
    for b in blocks:
      if b not in self._used:
        raise ValueError(f"BlockPool.free: page {b} is not in use (freed twice?)")
      self._used.remove(b)
      self._free.append(b)


def blocks_for(tokens: int, block_size: int) -> int:
  return -(-tokens // block_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
  """Per-layer key / value pages [G, N, P, K] (in cfg.cache_dtype, else the compute dtype)."""

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @classmethod
  def init(cls, cfg: LlamaConfig, num_blocks: int, block_size: int) -> PagedCache:
    shape = (cfg.n_kv_heads, num_blocks, block_size, cfg.head_dim)
    dtype = cfg.cache_dtype or cfg.dtype
    return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)),
               v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)))

  @property
  def num_blocks(self) -> int:
    return self.k[0].shape[1]

  @property
  def block_size(self) -> int:
    return self.k[0].shape[2]

  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.k + self.v)


def write_pages(pages_GNPK, slots_BT, new_BTGK):
  """pages with new[b, t] at flat slot slots[b, t] (page * P + offset); N*P drops it."""
  g, n, p, kd = pages_GNPK.shape
  new_GXK = new_BTGK.reshape(-1, g, kd).transpose(1, 0, 2).astype(pages_GNPK.dtype)
  flat = pages_GNPK.reshape(g, n * p, kd).at[:, slots_BT.reshape(-1)].set(new_GXK, mode="drop")
  return flat.reshape(g, n, p, kd)


def flat_slots(tables_BM, positions_BT, valid_BT, block_size: int, num_blocks: int):
  """Flat pool indices of tokens at `positions_BT` (N*P where not valid: dropped)."""
  page_BT = jnp.take_along_axis(tables_BM, positions_BT // block_size, axis=1, mode="clip")
  slots = page_BT * block_size + positions_BT % block_size
  return jnp.where(valid_BT, slots, num_blocks * block_size)


def _write_view(view_GBSK, positions_BT, valid_BT, new_BTGK):
  """view[:, b, positions[b, t]] = new[b, t] where valid (a gathered view: slot =
  position)."""
  b, t = positions_BT.shape
  at_BT = jnp.where(valid_BT, positions_BT, view_GBSK.shape[2])
  rows_BT = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
  return view_GBSK.at[:, rows_BT, at_BT].set(
      new_BTGK.transpose(2, 0, 1, 3).astype(view_GBSK.dtype), mode="drop")


@dataclasses.dataclass(frozen=True)
class PagedLayer:
  """One layer's pages and the call's tables, as `llm.model.Attention`'s `kv` (it calls
  `write_and_attend`). lengths_B: each row's tokens after this call's writes. After the
  call it holds the call's keys / values (`new_k`, `new_v`) for `commit_pages`; the pages
  are read only."""

  k_pages: jax.Array
  v_pages: jax.Array
  tables_BM: jax.Array
  lengths_B: jax.Array
  slots_BT: jax.Array
  impl: str                  # "xla" | "pallas" (after choose_paged_impl)
  dtype: jnp.dtype           # the compute dtype
  own_mask_BTT: jax.Array | None = None   # which of the call's keys each query sees (a tree)
  new_k: jax.Array | None = None
  new_v: jax.Array | None = None

  def write_and_attend(self, q_BTHK, k_BTGK, v_BTGK, positions_BT):
    """Attention of the call's queries over the cached slots and the call's own keys;
    returns (out_BTHK, layer holding the call's keys / values)."""
    n_slots = self.k_pages.shape[1] * self.k_pages.shape[2]
    valid_BT = self.slots_BT < n_slots
    # As stored, then read in the compute dtype (the same rounding as through the pool).
    cache_dtype = self.k_pages.dtype
    k_BTGK, v_BTGK = k_BTGK.astype(cache_dtype), v_BTGK.astype(cache_dtype)
    layer = dataclasses.replace(self, new_k=k_BTGK, new_v=v_BTGK)
    if self.impl == "pallas" or self.own_mask_BTT is not None:
      start_B = self.lengths_B - jnp.sum(valid_BT, axis=1, dtype=jnp.int32)
      if self.impl == "pallas":
        out_old, lse_old = paged_attention(
            q_BTHK, self.k_pages.astype(self.dtype), self.v_pages.astype(self.dtype),
            self.tables_BM, start_B, positions_BT)
      else:
        out_old, lse_old = attention_over_view(
            q_BTHK, gather_pages(self.k_pages, self.tables_BM).astype(self.dtype),
            gather_pages(self.v_pages, self.tables_BM).astype(self.dtype), start_B,
            positions_BT)
      seg_BT = valid_BT.astype(jnp.int32)
      mask = None
      if self.own_mask_BTT is not None:
        mask = self.own_mask_BTT & valid_BT[:, :, None] & valid_BT[:, None, :]
      out_new, lse_new = attention(q_BTHK, k_BTGK.astype(self.dtype), v_BTGK.astype(self.dtype),
                                   impl="xla", causal=True, q_positions=positions_BT,
                                   kv_positions=positions_BT, q_segment_ids=seg_BT,
                                   kv_segment_ids=seg_BT, mask=mask)
      out, _ = merge_partials([out_old, out_new], [lse_old, lse_new])
      return out.astype(q_BTHK.dtype), layer
    k_GBSK = _write_view(gather_pages(self.k_pages, self.tables_BM), positions_BT, valid_BT,
                         k_BTGK).astype(self.dtype)
    v_GBSK = _write_view(gather_pages(self.v_pages, self.tables_BM), positions_BT, valid_BT,
                         v_BTGK).astype(self.dtype)
    out, _ = attention_over_view(q_BTHK, k_GBSK, v_GBSK, self.lengths_B, positions_BT)
    return out, layer


@dataclasses.dataclass(frozen=True)
class PagedGroups:
  """Several groups of rows in one forward pass (a mixed batch: decode rows [W, 1] and a
  prefill chunk [R, C]): the model runs on their tokens flattened to [1, sum B_g * T_g], so
  the weights are read once for all of them, and each group attends as its own
  `PagedLayer`. new_k / new_v: the call's keys / values, flattened like the tokens."""

  groups: tuple[PagedLayer, ...]
  new_k: jax.Array | None = None
  new_v: jax.Array | None = None

  def write_and_attend(self, q_1NHK, k_1NGK, v_1NGK, positions_1N):
    outs, layers, at = [], [], 0
    for layer in self.groups:
      b, t = layer.slots_BT.shape
      cut = lambda x: x[0, at:at + b * t].reshape(b, t, *x.shape[2:])  # noqa: E731
      out, layer = layer.write_and_attend(cut(q_1NHK), cut(k_1NGK), cut(v_1NGK),
                                          cut(positions_1N))
      outs.append(out.reshape(1, b * t, *out.shape[2:]))
      layers.append(layer)
      at += b * t

    def flat(xs):
      return jnp.concatenate([x.reshape(1, -1, *x.shape[2:]) for x in xs], axis=1)
    return flat(outs), dataclasses.replace(
        self, groups=tuple(layers), new_k=flat([x.new_k for x in layers]),
        new_v=flat([x.new_v for x in layers]))


@functools.partial(jax.jit, donate_argnames=("cache",))
def commit_pages(cache: PagedCache, slots_BT, new_k_LBTGK, new_v_LBTGK) -> PagedCache:
  """The pool with each layer's new keys / values written at slots_BT (in place: the
  pool is donated), a step's second jitted call."""
  return PagedCache(tuple(write_pages(p, slots_BT, n) for p, n in zip(cache.k, new_k_LBTGK)),
                    tuple(write_pages(p, slots_BT, n) for p, n in zip(cache.v, new_v_LBTGK)))
