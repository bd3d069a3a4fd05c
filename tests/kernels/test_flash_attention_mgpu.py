"""kernels.flash_attention_mgpu (Mosaic GPU) vs the jnp reference: out, lse and dq, dk, dv.

The kernel cases run twice (JAX's `...InterpretTest(...Test)` pattern): TestMgpuInterpret runs
the kernels on CPU in Pallas's GPU interpret mode (warpgroups as threads; simulated SMEM, TMA,
barriers and wgmma; race detection on), so CI checks the kernels' schedules, masks, barrier
protocol and numerics without a GPU; TestMgpuGpu compiles and runs the same cases (and
bigger ones) on a Hopper GPU:
  JAX_PLATFORMS=cuda python -m pytest tests/kernels/test_flash_attention_mgpu.py -m gpu
TestMgpuLowering lowers the compiled kernels ahead of time for an abstract H100 (Pallas ->
Mosaic GPU, including the SMEM budget; the fused backward's TMA reduce-add, which the
interpreter lacks, is checked only there and on a GPU).

The interpreter's race detector does not see wgmma operand reads (its wgmma keeps no vector
clocks), so a warpgroup overwriting SMEM that another one's wgmma still reads goes
unnoticed. The slow-warpgroup tests widen every such window: they delay chosen warpgroups'
wgmma and TMA-load callbacks (`_SLOW`, installed into the interpreter when this module is
imported, before any kernel is traced) and require the same bits as an undelayed run.

GPU interpret mode runs each warpgroup's program on its own XLA CPU thread while the others
block in barrier waits, so it needs more CPU threads than a 2-core machine's default pool:
PJRT_NPROC is raised here before the CPU client starts (tests/conftest.py may set it too).
"""

from __future__ import annotations

import os

_PJRT_NPROC_PRESET = os.environ.get("PJRT_NPROC")
os.environ.setdefault("PJRT_NPROC", "16")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax._src import xla_bridge  # noqa: E402

from kernels import flash_attention_mgpu as fam  # noqa: E402
from kernels.flash_attention_reference import flash_attention_reference  # noqa: E402
from tests.kernels import attention_cases as cases  # noqa: E402

BF16, F16 = jnp.bfloat16, jnp.float16
# Normalized max error (max |a - b| / max |b|): a few units in the last place of the output
# dtype (bf16 2^-8, fp16 2^-11); accumulators, softmax statistics and lse are fp32.
OUT_TOL = {BF16: 2e-2, F16: 3e-3}
LSE_TOL = {BF16: 1e-5, F16: 1e-5}
GRAD_TOL = {BF16: 3e-2, F16: 5e-3}

# XLA CPU threads: PJRT_NPROC if it was set before the CPU client started, else the cores.
_POOL_THREADS = int(os.environ["PJRT_NPROC"] if _PJRT_NPROC_PRESET is not None
                    or not xla_bridge.backends_are_initialized() else os.cpu_count())


class _SlowWarpgroups:
  """Delays the GPU interpreter's wgmma and TMA-load callbacks of chosen warpgroups
  (0, 1: compute; 2: memory) by `delay[wg]` seconds; counts the delays it made."""

  CALLBACKS = ("wgmma", "copy_gmem_to_smem")

  def __init__(self):
    self.delay: dict[int, float] = {}
    self.delayed = 0
    self.installed = False

  def install(self):
    try:
      from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError:
      return
    if all(hasattr(gpu_callbacks, n) for n in self.CALLBACKS):
      for name in self.CALLBACKS:
        setattr(gpu_callbacks, name, self._wrap(getattr(gpu_callbacks, name)))
      self.installed = True

  def _wrap(self, fn):
    def wrapped(*args, thread, **kwargs):
      seconds = self.delay.get(int(thread.warpgroup_id), 0.0)
      if seconds:
        self.delayed += 1
        time.sleep(seconds)
      return fn(*args, thread=thread, **kwargs)
    return wrapped

  def run(self, delay: dict[int, float], fn, *args):
    """fn(*args) with these delays; fails unless some callback was delayed."""
    if not self.installed:
      pytest.skip("this jax's GPU interpreter has no wgmma / copy_gmem_to_smem callbacks")
    self.delay, self.delayed = delay, 0
    try:
      out = jax.block_until_ready(fn(*args))
    finally:
      self.delay = {}
    assert self.delayed > 0, f"no callback was delayed ({delay}): the kernel was traced " \
                             "before the delays were installed"
    return out


_SLOW = _SlowWarpgroups()
_SLOW.install()


def _check_against_reference(kernel, case, seed=0, results=None):
  """kernel's out, lse, dq, dk, dv (or `results`, computed before) vs the reference."""
  q, k, v, kw = cases.inputs(case, seed)
  dtype = case[7]
  o, l, grads = results if results is not None else cases.out_lse_grads(kernel, q, k, v, kw)
  o_ref, l_ref, grads_ref = cases.out_lse_grads(flash_attention_reference, q, k, v, kw)
  assert o.shape == q.shape and o.dtype == q.dtype
  assert l.shape == q.shape[:3] and l.dtype == jnp.float32
  np.testing.assert_array_equal(np.isfinite(l), np.isfinite(l_ref))
  assert cases.rel_err(o, o_ref) < OUT_TOL[dtype]
  fin = np.isfinite(np.asarray(l_ref))
  assert cases.rel_err(np.asarray(l)[fin], np.asarray(l_ref)[fin]) < LSE_TOL[dtype]
  for name, g, g_ref in zip("qkv", grads, grads_ref):
    assert g.shape == g_ref.shape and g.dtype == g_ref.dtype, name
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    err = cases.rel_err(g, g_ref)
    assert err < GRAD_TOL[dtype], f"d{name}: relative error {err:.2e}"


def _bits(results):
  """(out, lse, dq, dk, dv) as numpy arrays, for bitwise comparison."""
  o, l, grads = results
  return [np.asarray(x) for x in (o, l, *grads)]


class MgpuCases:
  """Kernel cases shared by the interpreted and the compiled class; subclasses give
  `_kernel` (interpret params or compiled) and parametrize test_matches_reference."""

  def _kernel(self, q, k, v, **kw):
    raise NotImplementedError

  def test_fully_masked_rows(self):
    """Rows with no allowed key: out exactly 0, lse -inf, zero dq, no NaN anywhere."""
    b, t, s, h, g, kd = 1, 128, 128, 2, 1, 64
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=shape), BF16)
               for shape in ((b, t, h, kd), (b, s, g, kd), (b, s, g, kd)))
    # Segment 7 has no keys; rows 0..3 sit before every key; segment 1 starts later in the
    # keys (72) than in the queries (64 + 4), so its first rows see no key either.
    q_seg = np.array([[0] * 64 + [1] * 40 + [7] * 24], np.int32)
    kv_seg = np.array([[0] * 72 + [1] * 56], np.int32)
    q_pos = np.array([np.arange(t) - 4], np.int32)
    allowed = (q_seg[0, :, None] == kv_seg[0, None, :]) & (np.arange(s)[None] <= q_pos[0, :, None])
    empty = ~allowed.any(axis=1)
    assert empty[:4].all() and empty[64:76].all() and empty[104:].all() and empty.sum() == 40
    kw = dict(causal=True, q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg),
              q_positions=jnp.asarray(q_pos))
    o, l, (dq, dk, dv) = cases.out_lse_grads(self._kernel, q, k, v, kw)
    np.testing.assert_array_equal(np.isneginf(np.asarray(l[0])), np.stack([empty] * h, 1))
    assert np.all(np.asarray(o, np.float32)[0, empty] == 0.0)
    for grad in (dq, dk, dv):
      assert np.all(np.isfinite(np.asarray(grad, np.float32)))
    assert np.all(np.asarray(dq, np.float32)[0, empty] == 0.0)
    o_ref, _, grads_ref = cases.out_lse_grads(flash_attention_reference, q, k, v, kw)
    assert cases.rel_err(o, o_ref) < OUT_TOL[BF16]
    for grad, grad_ref in zip((dq, dk, dv), grads_ref):
      assert cases.rel_err(grad, grad_ref) < GRAD_TOL[BF16]

  @pytest.mark.parametrize("bwd", ["split", "fused"])
  def test_both_backwards_at_head_dim_128(self, bwd):
    """Both backwards at head dim 128 on packed segments; the fused one with two batch rows
    (its only interpreted case with B > 1), the split one with one (the split kernels' batch
    axis is the B2 "seg" case's at head dim 64)."""
    fn = lambda q, k, v, **kw: self._kernel(q, k, v, bwd=bwd, **kw)
    b = 2 if bwd == "fused" else 1
    _check_against_reference(fn, (b, 128, 256, 2, 1, 128, True, BF16, "seg"), seed=4)

  def test_other_tiles(self):
    """Forward key blocks of 64 with 3 stages, backward blocks 64 x 64 and 128 x 64."""
    fn = lambda q, k, v, **kw: self._kernel(q, k, v, block_kv=64, stages=3, block_kv_dq=64,
                                            block_q_dkv=128, stages_bwd=3, **kw)
    _check_against_reference(fn, (1, 256, 320, 1, 1, 64, True, BF16, "seg"), seed=3)


# Small shapes: each case is one forward + two backward kernels through the interpreter.
INTERPRET_CASES = [
    (1, 200, 136, 2, 1, 64, True, F16, ""),            # padded T and S, multi-query, fp16
    (1, 128, 128, 2, 2, 128, False, BF16, ""),         # head dim 128 (fused backward)
    (1, 200, 136, 2, 1, 128, True, F16, ""),           # fused backward, padded, GQA 2/1
    (2, 128, 256, 1, 1, 64, True, BF16, "seg"),        # packed segments, empty blocks
    (1, 192, 128, 2, 2, 64, True, BF16, "seg+perm"),   # permuted positions
    (1, 256, 256, 1, 1, 64, True, F16, "pos"),         # ring-step offsets, skipped blocks
]
INTERPRET_CASES_SLOW = [
    (1, 256, 256, 4, 2, 64, True, BF16, ""),           # GQA, causal, diagonal blocks
    (1, 130, 70, 2, 1, 128, False, BF16, "seg"),       # non-causal segments, padding
    (2, 256, 128, 4, 1, 128, True, F16, "seg+pos"),
    (1, 192, 128, 2, 2, 128, True, BF16, "seg+perm"),
]
# Cases of the stress test: head dim 128 (both backwards), GQA, padding, segments, positions.
STRESS_CASES = [(1, 200, 136, 4, 1, 128, True, F16, ""),
                (2, 256, 128, 4, 2, 128, True, BF16, "seg+pos")]


class TestMgpuInterpret(MgpuCases):
  """Pallas's GPU interpreter on CPU, race detection on."""

  @pytest.fixture(autouse=True)
  def _interpreter(self):
    if jax.default_backend() != "cpu":
      pytest.skip("GPU interpret mode runs its warpgroups as CPU-backend programs; on a GPU "
                  "machine TestMgpuGpu runs these cases compiled")
    if _POOL_THREADS < 4:
      pytest.skip("GPU interpret mode needs >= 4 XLA CPU threads: set PJRT_NPROC=16 before "
                  "jax starts (the CPU client here was created with fewer)")
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    ipc.reset_gpu_interpret_mode_state()
    self.params = fam.plgpu.InterpretGPUParams(detect_races=True)
    yield
    assert not ipc.get_races().races_found, "the interpreter detected a data race"

  def _kernel(self, q, k, v, **kw):
    return fam.flash_attention_mgpu(q, k, v, interpret=self.params, **kw)

  @pytest.mark.parametrize("case", INTERPRET_CASES, ids=cases.case_id)
  def test_matches_reference(self, case):
    _check_against_reference(self._kernel, case)

  @pytest.mark.slow
  @pytest.mark.parametrize("case", INTERPRET_CASES_SLOW, ids=cases.case_id)
  def test_matches_reference_more(self, case):
    _check_against_reference(self._kernel, case)

  def test_fused_backward_with_a_slow_warpgroup(self):
    """Compute warpgroup 1 lags (every wgmma 50 ms late), so warpgroup 0 finishes first and
    stores dk into its half of the K tile while warpgroup 1's last dS K product reads that
    tile: without the barrier before that store, dq is wrong (relative error 0.5 - 0.8)."""
    case = (1, 128, 128, 2, 2, 128, False, BF16, "")
    q, k, v, kw = cases.inputs(case)
    fn = lambda q, k, v, **kw: self._kernel(q, k, v, bwd="fused", **kw)
    results = _SLOW.run({1: 0.05}, lambda: cases.out_lse_grads(fn, q, k, v, kw))
    _check_against_reference(fn, case, results=results)

  @pytest.mark.slow
  @pytest.mark.parametrize("bwd", ["fused", "split"])
  @pytest.mark.parametrize("case", STRESS_CASES, ids=cases.case_id)
  def test_backward_is_bitwise_deterministic(self, case, bwd):
    """The same inputs, run again and again, some runs with one warpgroup lagging (either
    compute warpgroup's wgmmas, or the memory warpgroup's TMA loads): out, lse, dq, dk, dv
    bitwise equal every time (and close to the reference)."""
    q, k, v, kw = cases.inputs(case)
    fn = lambda q, k, v, **kw: self._kernel(q, k, v, bwd=bwd, **kw)
    run = lambda: cases.out_lse_grads(fn, q, k, v, kw)
    first = run()
    _check_against_reference(fn, case, results=first)
    want = _bits(first)
    delays = [None, None, {0: 0.01}, {1: 0.01}, {2: 0.01}, {0: 0.005, 2: 0.01}]
    for delay in delays:
      got = _bits(run() if delay is None else _SLOW.run(delay, run))
      for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=f"{name} differs (delays {delay})")


def _brute_force_classes(causal, q_seg, kv_seg, q_pos, kv_pos, tq, tk):
  """FULL / PARTIAL / EMPTY of every (tile, block) pair from the elementwise mask."""
  allowed = np.ones((q_seg.shape[0], q_seg.shape[1], kv_seg.shape[1]), bool)
  allowed &= q_seg[:, :, None] == kv_seg[:, None, :]
  if causal:
    allowed &= kv_pos[:, None, :] <= q_pos[:, :, None]
  b, t, s = allowed.shape
  blocks = allowed.reshape(b, t // tq, tq, s // tk, tk)
  every, some = blocks.all(axis=(2, 4)), blocks.any(axis=(2, 4))
  return np.where(every, fam.FULL, np.where(some, fam.PARTIAL, fam.EMPTY))


class TestSchedules:
  """Block classification and schedules in plain jnp (what the kernels walk)."""

  @pytest.mark.parametrize("kind", ["sorted", "shuffled"])
  def test_classes_are_conservative_and_tight_when_monotone(self, kind):
    rng = np.random.default_rng(0)
    b, t, s, tq, tk = 3, 256, 384, 32, 64
    q_seg = np.sort(rng.integers(0, 5, (b, t)), axis=1)
    kv_seg = np.sort(rng.integers(0, 5, (b, s)), axis=1)
    q_pos = np.broadcast_to(np.arange(t) + 100, (b, t)).copy()
    kv_pos = np.broadcast_to(np.arange(s), (b, s)).copy()
    if kind == "shuffled":
      for x in (q_seg, kv_seg, q_pos, kv_pos):
        for row in x:
          rng.shuffle(row)
    got = np.asarray(fam.classify_blocks(True, *(jnp.asarray(x, jnp.int32) for x in (
        q_seg, kv_seg, q_pos, kv_pos)), tq, tk))
    want = _brute_force_classes(True, q_seg, kv_seg, q_pos, kv_pos, tq, tk)
    # FULL and EMPTY are claims about every pair; PARTIAL may hide either.
    assert np.all(want[got == fam.FULL] == fam.FULL)
    assert np.all(want[got == fam.EMPTY] == fam.EMPTY)
    if kind == "sorted":  # monotone within blocks: min / max are exact
      np.testing.assert_array_equal(got, want)
    else:
      assert np.any(got == fam.PARTIAL)

  def test_schedule_order_and_counts(self):
    cls = jnp.asarray([[[2, 1, 0, 1, 0, 2], [2, 2, 2, 2, 2, 2]]], jnp.int32)
    order, counts = fam.schedule_from_classes(cls)
    np.testing.assert_array_equal(counts, [[[2, 4], [0, 0]]])
    np.testing.assert_array_equal(order[0, 0, :4], [2, 4, 1, 3])    # FULL first, then PARTIAL

  def test_padded_key_block_is_partial(self):
    seg = jnp.zeros((1, 256), jnp.int32)
    cls = fam.classify_blocks(False, seg, seg, None, None, 128, 64, partial_kv=3)
    np.testing.assert_array_equal(cls[0, :, 3], [fam.PARTIAL] * 2)
    assert np.all(np.asarray(cls[0, :, :3]) == fam.FULL)


class TestMgpuInputs:

  def test_supports(self):
    assert fam.supports(BF16, 128) and fam.supports(F16, 64)
    assert not fam.supports(jnp.float32, 128)
    assert not fam.supports(BF16, 96) and not fam.supports(BF16, 256)
    assert not fam.supports(BF16, 128, scale=-1.0)

  @pytest.mark.parametrize("change,match", [
      (dict(dtype=jnp.float32), "expected one of bfloat16, float16"),
      (dict(kd=96), "head dim 96"),
      (dict(block_q=96), "block_q=96"),
      (dict(scale=0.0), "scale=0.0"),
      (dict(stages=1), "stages=1"),
      (dict(bwd="fused"), "bwd='fused' with head dim 64"),
  ])
  def test_rejects(self, change, match):
    kd = change.pop("kd", 64)
    dtype = change.pop("dtype", BF16)
    q = jnp.zeros((1, 64, 2, kd), dtype)
    k = jnp.zeros((1, 64, 1, kd), dtype)
    with pytest.raises(ValueError, match=match):
      fam.flash_attention_mgpu(q, k, k, interpret=False, **change)


def _lower_for_h100(fn, *args):
  """StableHLO text of jit(fn) lowered for an abstract H100 from this CPU."""
  from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
  device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
  mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
  with use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


class TestMgpuLowering:
  """Ahead-of-time lowering for an H100 from this CPU: the Pallas -> Mosaic GPU lowering of
  all three kernels (layouts, wgmma shapes, TMA slices, SMEM <= 227 KiB) must succeed.
  PTX generation and ptxas run at compile time, on a GPU machine."""

  @pytest.mark.parametrize("dtype,kd,causal,masks,bwd", [
      (BF16, 128, True, "", "fused"), (F16, 128, False, "", "fused"),
      (BF16, 128, True, "seg+pos", "fused"), (BF16, 128, True, "", "split"),
      (BF16, 64, True, "seg+pos", "split"), (F16, 64, False, "seg", "split")])
  def test_lowers_for_h100(self, dtype, kd, causal, masks, bwd):
    q, k, v, kw = cases.inputs((1, 1000, 1024, 4, 2, kd, causal, dtype, masks))
    fn = lambda q, k, v, **kw: fam.flash_attention_mgpu(q, k, v, interpret=False, bwd=bwd, **kw)
    hlo = _lower_for_h100(lambda q, k, v: cases.vjp_outputs(fn, q, k, v, kw), q, k, v)
    # forward + (dq and dk/dv, or the fused backward)
    assert hlo.count("stablehlo.custom_call @mosaic_gpu") == (3 if bwd == "split" else 2)

  def test_remat_attention_policy_keeps_the_forward(self):
    """llm.remat's "attention" policy saves only what the attention kernels name (out,
    lse): the rematerialized backward reuses the forward kernel's outputs, as many kernel
    calls as without remat (with nothing named, the forward runs again, as under full
    remat)."""
    from llm.remat import remat_policy
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), BF16)
    k = jax.ShapeDtypeStruct((1, 256, 1, 64), BF16)
    loss = lambda q, k, v: jnp.sum(
        fam.flash_attention_mgpu(q, k, v, interpret=False)[0].astype(jnp.float32))
    calls = lambda f: _lower_for_h100(jax.value_and_grad(f, argnums=(0, 1, 2)), q, k, k).count(
        "stablehlo.custom_call @mosaic_gpu")
    # value_and_grad: the loss is used, so the primal forward stays (with grad alone, full
    # remat's primal pass would be dead code and its forward the only one).
    plain = calls(loss)                      # forward, dq, dk / dv (the split backward)
    assert calls(jax.checkpoint(loss, policy=remat_policy("attention"))) == plain == 3
    assert calls(jax.checkpoint(loss)) == plain + 1

  def test_smem_budget_is_checked(self):
    """Three forward stages of 128 x 128 tiles exceed 227 KiB: the lowering says so."""
    q = jax.ShapeDtypeStruct((1, 512, 2, 128), BF16)
    k = jax.ShapeDtypeStruct((1, 512, 2, 128), BF16)
    with pytest.raises(ValueError, match="shared memory"):
      _lower_for_h100(lambda q, k: fam.flash_attention_mgpu(q, k, k, stages=3, interpret=False),
                      q, k)


def _on_hopper() -> bool:
  return (jax.default_backend() == "gpu"
          and getattr(jax.devices()[0], "compute_capability", None) == "9.0")


GPU_CASES = [
    (2, 1024, 1024, 8, 2, kd, causal, dtype, masks)
    for kd in (64, 128) for causal in (True, False) for dtype in (BF16, F16)
    for masks in ("", "seg", "pos", "seg+pos")
    if causal or "pos" not in masks
] + [(1, 1000, 1100, 4, 4, 128, True, BF16, "seg+perm"), (3, 4096, 4096, 4, 1, 128, True, BF16, "")]


@pytest.mark.gpu
class TestMgpuGpu(MgpuCases):
  """Compiled on a Hopper GPU (sm_90): forward and both backward kernels vs the reference,
  the interpreted cases and bigger ones."""

  @pytest.fixture(autouse=True)
  def _needs_hopper(self):
    if not _on_hopper():
      pytest.skip("needs a Hopper GPU (compute capability 9.0; run with JAX_PLATFORMS=cuda)")

  def _kernel(self, q, k, v, **kw):
    return fam.flash_attention_mgpu(q, k, v, interpret=False, **kw)

  @pytest.mark.parametrize("case", INTERPRET_CASES + INTERPRET_CASES_SLOW + GPU_CASES,
                           ids=cases.case_id)
  def test_matches_reference(self, case):
    _check_against_reference(self._kernel, case)

  @pytest.mark.parametrize("case", [c for c in GPU_CASES if c[5] == 128], ids=cases.case_id)
  def test_split_backward_at_head_dim_128(self, case):
    _check_against_reference(lambda q, k, v, **kw: self._kernel(q, k, v, bwd="split", **kw),
                             case)

  @pytest.mark.parametrize("bwd", ["fused", "split"])
  def test_backward_repeats(self, bwd):
    """Ten runs on the same inputs: out, lse, dk, dv (and the split dq) bitwise equal. The
    fused dq adds the CTAs' partials by TMA reduce-add in whatever order they land, so it
    is equal up to fp32 rounding order only."""
    case = (2, 2048, 2048, 8, 2, 128, True, BF16, "seg+pos")
    q, k, v, kw = cases.inputs(case)
    fn = lambda q, k, v, **kw: self._kernel(q, k, v, bwd=bwd, **kw)
    runs = [_bits(cases.out_lse_grads(fn, q, k, v, kw)) for _ in range(10)]
    for got in runs[1:]:
      for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, runs[0]):
        if name == "dq" and bwd == "fused":
          assert cases.rel_err(a, b) < 2 ** -7, name
        else:
          np.testing.assert_array_equal(a, b, err_msg=name)

  def test_chooser_picks_mgpu(self):
    from llm.attention.choose import choose_kernel, device_info
    runtime = device_info().cuda_runtime
    bad_ptxas = runtime is not None and 12080 <= runtime < 12091
    assert choose_kernel(BF16, 128) == ("pallas_triton" if bad_ptxas else "pallas_mgpu")
    assert choose_kernel(BF16, 128, causal=False) == "pallas_mgpu"
    assert choose_kernel(jnp.float32, 128) == "pallas_triton"
