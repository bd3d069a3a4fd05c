"""kernels.paged_attention vs its jnp reference (gathered pages, `attention_over_view`), and the
reference against the flash attention reference over a contiguous cache.

TestPagedAttentionInterpret runs the Pallas kernel in interpret mode on CPU (in CI);
TestPagedAttentionGpu compiles it (Triton lowering) and skips without a GPU:
JAX_PLATFORMS=cuda python -m pytest tests/kernels/test_paged_attention.py -m gpu.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.flash_attention_reference import flash_attention_reference
from kernels.paged_attention import paged_attention, paged_attention_reference
from tests.kernels.attention_cases import rel_err

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = {F32: 2e-5, BF16: 2e-2}

# (B, T, H, G, K, N pages, P slots per page, M table width, dtype): decode steps (T = 1)
# and prefill chunks (T > 1), GQA groups of 2-3, a row with nothing cached.
CASES = [
    (3, 1, 4, 2, 32, 12, 16, 4, F32),
    (2, 13, 6, 2, 64, 8, 32, 2, BF16),        # pages of 32
]


def _case_id(c):
  b, t, h, g, k, n, p, m, dt = c
  return f"B{b}T{t}H{h}G{g}K{k}N{n}P{p}M{m}-{jnp.dtype(dt).name}"


def _inputs(case, seed=0):
  """Random pages and tables; row 0 has all its M pages' slots but the last few, the last
  row nothing cached (its queries see no key); the queries are the last T written tokens."""
  b, t, h, g, kd, n, p, m, dtype = case
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, t, h, kd)), dtype)
  k_pages = jnp.asarray(rng.normal(size=(g, n, p, kd)), dtype)
  v_pages = jnp.asarray(rng.normal(size=(g, n, p, kd)), dtype)
  tables = jnp.asarray(rng.permutation(np.arange(1, n))[:b * m].reshape(b, m) if b * m < n
                       else rng.integers(1, n, (b, m)), jnp.int32)
  lengths = np.asarray([m * p - 3] + [int(rng.integers(t, m * p)) for _ in range(b - 2)] + [0],
                       np.int32)
  q_pos = np.maximum(lengths[:, None] - t + np.arange(t)[None, :], 0).astype(np.int32)
  q_pos[-1] = np.arange(t)            # the empty row's queries: positions with no key written
  return q, k_pages, v_pages, tables, jnp.asarray(lengths), jnp.asarray(q_pos)


def test_reference_equals_attention_over_a_contiguous_cache():
  """Pages laid end to end per row are the cache the shared reference reads."""
  b, t, h, g, kd, n, p, m = 2, 3, 4, 2, 16, 7, 4, 3
  rng = np.random.default_rng(1)
  cache_k = rng.normal(size=(b, m * p, g, kd)).astype(np.float32)
  cache_v = rng.normal(size=(b, m * p, g, kd)).astype(np.float32)
  tables = np.asarray([[5, 1, 3], [2, 6, 4]], np.int32)
  k_pages = np.zeros((g, n, p, kd), np.float32)
  v_pages = np.zeros((g, n, p, kd), np.float32)
  for row in range(b):
    for i, page in enumerate(tables[row]):
      k_pages[:, page] = cache_k[row, i * p:(i + 1) * p].transpose(1, 0, 2)
      v_pages[:, page] = cache_v[row, i * p:(i + 1) * p].transpose(1, 0, 2)
  lengths = np.asarray([10, 7], np.int32)
  q = jnp.asarray(rng.normal(size=(b, t, h, kd)), F32)
  q_pos = jnp.asarray(lengths[:, None] - t + np.arange(t), jnp.int32)
  out, lse = jax.jit(paged_attention_reference)(q, jnp.asarray(k_pages), jnp.asarray(v_pages),
                                                jnp.asarray(tables), jnp.asarray(lengths), q_pos)
  ref = jax.jit(flash_attention_reference, static_argnames="causal")
  for row in range(b):
    ln = lengths[row]
    want, want_lse = ref(q[row:row + 1], jnp.asarray(cache_k[row:row + 1, :ln]),
                         jnp.asarray(cache_v[row:row + 1, :ln]), causal=True,
                         q_positions=q_pos[row:row + 1])
    np.testing.assert_allclose(out[row:row + 1], want, atol=1e-6)
    np.testing.assert_allclose(lse[row:row + 1], want_lse, atol=1e-6)


class _PagedAttentionCases:
  interpret: bool

  @pytest.mark.parametrize("case", CASES, ids=_case_id)
  def test_matches_reference(self, case):
    args = _inputs(case)
    out, lse = paged_attention(*args, interpret=self.interpret)
    out_ref, lse_ref = paged_attention_reference(*args)
    dtype = case[-1]
    assert out.shape == out_ref.shape and out.dtype == out_ref.dtype
    assert rel_err(out, out_ref) < TOL[dtype]
    assert np.all(np.isneginf(np.asarray(lse[-1])))       # the empty row sees no key
    assert np.all(np.asarray(out[-1]) == 0)
    assert rel_err(lse[:-1], lse_ref[:-1]) < TOL[dtype]


  def test_lengths_past_the_table_read_only_its_slots(self):
    """A length beyond the table's M * P slots (and queries past it) sees the M * P slots, as
    the reference does; the kernel walked past the table's last page into whatever follows
    it (row 0's table, here, in interpret mode). fp32: TOL as in test_matches_reference."""
    case = (2, 2, 4, 2, 16, 9, 16, 2, F32)
    q, kp, vp, tables, _, _ = _inputs(case, seed=2)
    lengths = jnp.asarray([40, 33], jnp.int32)              # M * P = 32
    q_pos = jnp.asarray([[38, 39], [20, 45]], jnp.int32)
    out, lse = paged_attention(q, kp, vp, tables, lengths, q_pos, interpret=self.interpret)
    out_ref, lse_ref = paged_attention_reference(q, kp, vp, tables, lengths, q_pos)
    assert rel_err(out, out_ref) < TOL[F32] and rel_err(lse, lse_ref) < TOL[F32]
    full = jnp.full((2,), 32, jnp.int32)                    # the same keys as a full table
    out_full, _ = paged_attention_reference(q, kp, vp, tables, full, q_pos)
    assert rel_err(out_ref, out_full) == 0


class TestPagedAttentionInterpret(_PagedAttentionCases):
  """Pallas interpreter on CPU."""
  interpret = True

  @pytest.mark.parametrize("dtype", [BF16])
  def test_lowers_to_triton_for_hopper(self, dtype):
    """AOT-lower a decode step's call for an H100 from this CPU: the kernel body must lower
    to Triton IR (Triton's own passes and ptxas run only on a GPU machine)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    s = jax.ShapeDtypeStruct
    i32 = jnp.int32
    args = (s((8, 1, 9, 64), dtype), s((3, 64, 16, 64), dtype), s((3, 64, 16, 64), dtype),
            s((8, 8), i32), s((8,), i32), s((8, 1), i32))
    run = jax.jit(lambda *a: paged_attention(*a, interpret=False))
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with use_abstract_mesh(mesh), warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)    # the Triton backend's notice
      hlo = run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 1

  def test_rejects_a_page_size_the_tiles_cannot_take(self):
    q, kp, vp, tables, lengths, q_pos = _inputs((2, 1, 2, 1, 16, 6, 16, 2, F32))
    with pytest.raises(ValueError, match="page size 8; expected a power of two >= 16"):
      paged_attention(q, kp[:, :, :8], vp[:, :, :8], tables, lengths, q_pos, interpret=True)


@pytest.mark.gpu
class TestPagedAttentionGpu(_PagedAttentionCases):
  """Compiled (Triton lowering) on a GPU."""
  interpret = False

  @pytest.fixture(autouse=True)
  def _needs_gpu(self):
    if jax.default_backend() != "gpu":
      pytest.skip("needs a GPU (run with JAX_PLATFORMS=cuda)")
