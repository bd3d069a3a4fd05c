"""Token layouts for context parallelism (arXiv 2411.01783, Sec. 3): load balancing, decode slots.

Causal attention gives late tokens more work than early ones, so a sequence cut into N
contiguous pieces leaves the last rank with most of the work. The paper cuts it into 2N
chunks and gives rank i chunks i and 2N-1-i (one early, one late), so every rank does the
same work. `load_balance` reorders a sequence so that an ordinary contiguous split over N
ranks (a `cp`-sharded array) yields exactly that; `unload_balance` undoes it. Apply both to
positions and segment ids too: ring attention masks by explicit positions, so any placement
is exact as long as the positions travel with the tokens.

Decode appends one token per step; `decode_placement` puts the KV of decode token d on
rank d mod N (round robin, so the cache stays balanced as it grows).

`cache_slots` is the rule the Llama model (llm/model.py) uses for a KV cache whose slot axis
is split over the N ranks (rank r owns slots [r*C, (r+1)*C), filled from the front): a call's
tokens sharded over cp go to their own rank's next free slots (so a load-balanced prefill
leaves chunks i and 2N-1-i on rank i and the write moves nothing between ranks); tokens
that are not sharded (a decode step) continue the round robin from the least-filled rank,
which after a balanced prefill is exactly `decode_placement`.

Works on host numpy arrays (returns numpy) and on jax arrays / tracers under jit.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp


def balanced_order(n: int) -> np.ndarray:
  """Chunk order [0, 2n-1, 1, 2n-2, ...]: position c of the result holds original chunk order[c]."""
  if n < 1:
    raise ValueError(f"load balance: n={n} ranks, expected n >= 1")
  return np.array([c for i in range(n) for c in (i, 2 * n - 1 - i)], dtype=np.int32)


def _permute_chunks(x, n: int, axis: int, order: np.ndarray, what: str):
  xp = np if isinstance(x, (np.ndarray, np.generic, list, tuple)) else jnp
  x = xp.asarray(x)
  axis = axis % x.ndim
  length = x.shape[axis]
  if length % (2 * n):
    raise ValueError(f"{what}: axis {axis} has length {length}, expected a multiple of "
                     f"2*n = {2 * n} (2 chunks per rank)")
  chunk = length // (2 * n)
  x = x.reshape(x.shape[:axis] + (2 * n, chunk) + x.shape[axis + 1:])
  x = xp.take(x, order, axis=axis)
  return x.reshape(x.shape[:axis] + (length,) + x.shape[axis + 2:])


def load_balance(x, n: int, axis: int = 1):
  """Reorders `axis` (length divisible by 2n) so that contiguous shard i holds chunks i, 2n-1-i."""
  return _permute_chunks(x, n, axis, balanced_order(n), "load_balance")


def unload_balance(x, n: int, axis: int = 1):
  """Inverse of `load_balance`: back to the natural token order."""
  return _permute_chunks(x, n, axis, np.argsort(balanced_order(n)).astype(np.int32),
                         "unload_balance")


def balanced_positions(batch: int, length: int, n: int, offset: int = 0) -> np.ndarray:
  """Positions [batch, length] (offset + arange) in the load-balanced order for n ranks."""
  pos = np.broadcast_to(np.arange(length, dtype=np.int32) + offset, (batch, length))
  return load_balance(pos, n, axis=1)


def decode_placement(step, n: int, *, prefill_per_rank: int, capacity_per_rank: int):
  """Where decode token `step` (0 = first token after the prefill) keeps its KV.

  The KV cache is a global [B, n * capacity_per_rank, G, K] array sharded contiguously over
  the n `cp` ranks; each rank's first `prefill_per_rank` slots hold its prefill tokens.
  Decode tokens go round robin: rank = step mod n, local slot = prefill_per_rank + step // n.
  Returns (rank, local_slot, global_slot) with global_slot = rank * capacity_per_rank +
  local_slot; `step` may be an int or an integer array (numpy or jax).
  """
  if isinstance(step, (int, np.integer)):
    if step < 0:
      raise ValueError(f"decode_placement: step={step}, expected >= 0")
    local = prefill_per_rank + step // n
    if local >= capacity_per_rank:
      raise ValueError(
          f"decode_placement: step={step} needs local slot {local} on rank {step % n}, but "
          f"each rank holds {capacity_per_rank} slots ({prefill_per_rank} used by prefill)")
    rank = step % n
    return rank, local, rank * capacity_per_rank + local
  rank = step % n
  local = prefill_per_rank + step // n
  return rank, local, rank * capacity_per_rank + local


def cache_slots(fill_BN, valid_BT, capacity: int, *, sharded: bool):
  """Global slots [B, T] (int32) for a call's new tokens in a cache split over N ranks.

  fill_BN: slots already used on each rank (rank r owns global slots r*capacity + [0,
  capacity) and fills them from the front); valid_BT: which tokens are written (False:
  padding). sharded=True: the T tokens (T a multiple of N, in the order of a cp-sharded
  array, e.g. `load_balance`d) are split contiguously, token j on rank j // (T/N), and each
  rank's valid tokens take its next free slots in order. sharded=False: the k-th valid token
  goes to rank (r0 + k) mod N, r0 the least-filled rank (the lowest on ties), at local slot
  fill + k // N. Padding, and tokens past a rank's capacity, get slot N * capacity (out of
  range: a scatter with mode="drop" skips them).
  """
  xp = np if isinstance(fill_BN, (np.ndarray, list, tuple)) and isinstance(
      valid_BT, (np.ndarray, list, tuple)) else jnp
  fill = xp.asarray(fill_BN).astype(xp.int32)
  valid = xp.asarray(valid_BT).astype(bool)
  b, n = fill.shape
  t = valid.shape[1]
  if valid.shape[0] != b:
    raise ValueError(f"cache_slots: fill_BN {fill.shape} and valid_BT {valid.shape} disagree "
                     "on the batch size")
  if sharded:
    if t % n:
      raise ValueError(f"cache_slots: sharded=True needs T={t} to be a multiple of the "
                       f"{n} ranks")
    per = t // n
    rank = xp.broadcast_to(xp.arange(t, dtype=xp.int32) // per, (b, t))
    k = (xp.cumsum(valid.reshape(b, n, per), axis=-1, dtype=xp.int32) - 1).reshape(b, t)
    local = xp.take_along_axis(fill, rank, axis=1) + k
  else:
    k = xp.cumsum(valid, axis=1, dtype=xp.int32) - 1
    rank = (xp.argmin(fill, axis=1).astype(xp.int32)[:, None] + k) % n
    local = xp.take_along_axis(fill, rank, axis=1) + k // n
  ok = valid & (local < capacity)
  return xp.where(ok, rank * capacity + local, n * capacity).astype(xp.int32)
