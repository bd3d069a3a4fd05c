"""llm/packing (WLB-LLM, arXiv 2503.17924) on the host: packers, packed rows, CP layouts, cost fit.

Packers are checked against plain-Python restatements of their rules and for what training
needs: no document dropped, duplicated or split, tokens of a document in order, every
micro-batch within its token cap, outliers released M at a time. CP layouts: permutations
whose ranks hold each document's head / tail chunks, token counts equal, round trips, visible
pairs counted against the attention mask, tile classes against the Mosaic GPU kernel's rule.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from llm.attention import layout
from llm.packing import batch as B
from llm.packing import cost as C
from llm.packing import cp_shard as S
from llm.packing import packers as P
from llm.packing.lengths import LengthDist

COST = C.CostModel(attn_quad=1e-3, attn_lin=0.1, attn_const=2.0, lin_per_token=1.0,
                   lin_const=5.0)


def _stream(n=600, seed=0, cap=512):
  rng = np.random.default_rng(seed)
  x = np.exp(rng.normal(3.5, 1.2, n))
  long = rng.uniform(size=n) < 0.04
  x[long] = rng.uniform(cap / 4, cap, size=long.sum())
  return np.clip(np.round(x), 1, cap).astype(np.int64)


# ----------------------------------------------------------------------------- packers


def test_original_packing_is_next_fit_in_order():
  lengths = _stream()
  steps = P.original_packing(lengths, seq_len=512, micro_batches=4)
  flat = [i for s in steps for mb in s for i in mb]
  assert flat == list(range(len(flat)))                      # arrival order, nothing skipped
  seqs = [mb for s in steps for mb in s]
  assert all(len(s) == 4 for s in steps)
  for a, b in zip(seqs, seqs[1:]):
    assert lengths[a].sum() <= 512
    assert lengths[a].sum() + lengths[b[0]] > 512             # the next document did not fit
  with pytest.raises(ValueError, match="document 3 has 600 tokens"):
    P.original_packing(np.array([5, 5, 5, 600]), seq_len=512, micro_batches=2)


def _greedy_reference(lengths, bins, cap, cost):
  """balanced_pack restated: longest first, smallest load among bins with room."""
  order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
  load, used, out, left = [0.0] * bins, [0] * bins, [[] for _ in range(bins)], []
  for k in order:
    cands = [j for j in range(bins) if used[j] + lengths[k] <= cap]
    if not cands:
      left.append(k)
      continue
    j = min(cands, key=lambda j: (load[j], j))
    out[j].append(k)
    load[j] += float(cost.doc_total(lengths[k]))
    used[j] += lengths[k]
  return out, left


def test_balanced_pack_matches_reference():
  lengths = _stream(120, seed=3)
  got = P.balanced_pack(np.arange(120), lengths, bins=6, capacity=700, doc_cost=COST.doc_total)
  want = _greedy_reference(lengths.tolist(), 6, 700, COST)
  assert got == want
  assert want[1], "the test stream should overflow the bins"


def _check_run(run, lengths, arrivals, cap, m):
  """Every arrived document placed at most once, the rest pending; micro-batches fit."""
  placed = [i for s in run.steps for mb in s for i in mb]
  assert len(placed) == len(set(placed))
  arrived = {i for a in arrivals for i in a}
  assert set(placed) <= arrived
  assert len(arrived) - len(placed) == run.pending
  for s in run.steps:
    assert len(s) == m
    for mb in s:
      assert lengths[np.asarray(mb, np.int64)].sum() <= cap


@pytest.mark.parametrize("window", [1, 2, 4])
def test_fixed_greedy_places_everything_within_seq_len(window):
  lengths = _stream(1500, seed=window)
  orig = P.original_packing(lengths, seq_len=512, micro_batches=4, steps=16)
  arrivals = [[i for mb in s for i in mb] for s in orig]
  run = P.simulate("g", lengths, arrivals, packer=P.FixedGreedyPacker(
      seq_len=512, micro_batches=4, window=window, cost=COST))
  _check_run(run, lengths, arrivals, 512, 4)
  assert len(run.steps) == 16
  # Steps of a window are dealt heaviest first.
  for g in range(0, 16, window):
    w = [max(COST.total(lengths[np.asarray(mb, np.int64)]) for mb in s)
         for s in run.steps[g:g + window]]
    assert w == sorted(w, reverse=True)


def test_wlb_outlier_queues_release_m_at_a_time():
  lengths = _stream(3000, seed=7)
  m, thr = 4, (128, 256)
  orig = P.original_packing(lengths, seq_len=512, micro_batches=m, steps=40)
  arrivals = [[i for mb in s for i in mb] for s in orig]
  packer = P.WLBPacker(micro_batches=m, max_len=768, cost=COST, outlier_thresholds=thr)
  run = P.simulate("wlb", lengths, arrivals, packer=packer)
  _check_run(run, lengths, arrivals, 768, m)
  arrival = P.arrival_steps(orig, len(lengths))
  # Plain-Python queues: an outlier is trained in the step its queue reaches m documents;
  # a lone release (the longest documents of its step) sits in m different micro-batches.
  queues = {0: [], 1: []}
  lone = 0
  for g, a in enumerate(arrivals):
    for i in a:
      if lengths[i] >= thr[0]:
        queues[int(lengths[i] >= thr[1])].append(i)
    releases = []
    for q in queues.values():
      if len(q) >= m:
        out, q[:] = q[:m], q[m:]
        assert all(run.placed_step[i] == g for i in out), (g, out)
        releases.append(out)
    if len(releases) == 1:
      where = [next(j for j, mb in enumerate(run.steps[g]) if i in mb) for i in releases[0]]
      assert sorted(where) == list(range(m))
      lone += 1
  assert lone >= 3
  assert {i for q in queues.values() for i in q} <= set(packer.pending())
  assert np.all(run.placed_step[run.placed_step >= 0] >= arrival[run.placed_step >= 0])
  d = P.token_delay(run, lengths, arrival)
  assert 0 < d["mean_delay_steps"] and 0 < d["delayed_token_fraction"] < 1


def test_wlb_balances_better_than_original():
  lengths = _stream(4000, seed=11)
  orig = P.original_packing(lengths, seq_len=512, micro_batches=4, steps=48)
  arrivals = [[i for mb in s for i in mb] for s in orig]
  base = P.step_imbalance(P.simulate("o", lengths, arrivals, original=orig), lengths, COST)
  wlb = P.step_imbalance(P.simulate("w", lengths, arrivals, packer=P.WLBPacker(
      micro_batches=4, max_len=768, cost=COST, outlier_thresholds=(256,))), lengths, COST)
  assert wlb.mean() < base.mean() - 0.1, (wlb.mean(), base.mean())


def test_packer_arguments_are_checked():
  with pytest.raises(ValueError, match="increasing"):
    P.WLBPacker(micro_batches=2, max_len=10, cost=COST, outlier_thresholds=(8, 4))
  with pytest.raises(ValueError, match="document 7 has 11 tokens"):
    P.WLBPacker(micro_batches=2, max_len=10, cost=COST).pack([7], lambda ids: np.array([11]))


# ----------------------------------------------------------------------------- packed rows


def _docs(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, 256, size=l).astype(np.int32) for l in lengths]


def test_to_lm_batch_round_trips_documents():
  docs = _docs([5, 1, 9, 3, 7, 2])
  rows = [[2, 0], [5, 1, 3], [4]]
  b = B.to_lm_batch(docs, rows, 16)
  got = B.unpack_rows(b)
  for r, row in enumerate(rows):
    assert len(got[r]) == len(row)
    for i, tok in zip(row, got[r]):
      np.testing.assert_array_equal(tok, docs[i])
  # Targets: the next token of the same document; none across documents or on padding.
  o = 0
  for i in rows[1]:
    d = docs[i]
    np.testing.assert_array_equal(b.targets[1, o:o + len(d) - 1], d[1:])
    assert b.mask[1, o + len(d) - 1] == 0 and np.all(b.mask[1, o:o + len(d) - 1] == 1)
    o += len(d)
  assert np.all(b.mask[1, o:] == 0) and np.all(b.segment_ids[1, o:] == 0)
  np.testing.assert_array_equal(b.positions[1, :8], [0, 1, 0, 0, 1, 2, 0, 1])
  seg, pos = B.row_segments([len(docs[i]) for i in rows[1]], 16)
  np.testing.assert_array_equal(seg, b.segment_ids[1])
  np.testing.assert_array_equal(pos, b.positions[1])
  assert B.row_documents(b.segment_ids[1]) == [(1, 2), (2, 1), (3, 3)]
  with pytest.raises(ValueError, match="row 0 holds documents"):
    B.to_lm_batch(docs, [[2, 4]], 15)
  with pytest.raises(ValueError, match="segment id 1 appears in two"):
    B.row_documents(np.array([1, 1, 2, 1, 0]))


# ----------------------------------------------------------------------------- CP layouts


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_per_document_order_head_tail_chunks(n):
  lengths = [37, 5, 64, 1, 19, 2 * n, 3]
  t = 160
  order = S.per_document_order(lengths, t, n)
  assert sorted(order.tolist()) == list(range(t))            # a permutation
  per = t // n
  starts = np.cumsum([0] + lengths[:-1])
  for d, (s0, l) in enumerate(zip(starts, lengths)):
    # Chunks in document order: rank 0..n-1 heads, then rank n-1..0 tails; contiguous.
    pieces = []
    for r in range(n):
      mine = order[r * per:(r + 1) * per]
      idx = mine[(mine >= s0) & (mine < s0 + l)] - s0
      k = len(idx)
      assert k in (2 * (l // (2 * n)), 2 * (l // (2 * n)) + 1, 2 * (l // (2 * n)) + 2)
      pieces.append(idx)
    heads, tails = [], []
    for r, idx in enumerate(pieces):
      gaps = np.flatnonzero(np.diff(idx) != 1)
      assert len(gaps) <= 1                                  # a head run and a tail run
      cut = gaps[0] + 1 if len(gaps) else (len(idx) if r < n - 1 or n == 1 else len(idx))
      heads.append(idx[:cut])
      tails.append(idx[cut:])
    flat = np.concatenate(heads + tails[::-1])
    np.testing.assert_array_equal(np.sort(flat), np.arange(l))
  counts = [np.sum(order[r * per:(r + 1) * per] < sum(lengths)) for r in range(n)]
  assert max(counts) - min(counts) <= 1
  # Round trip through a batch.
  x = np.arange(t)[None] * 10
  np.testing.assert_array_equal(S.restore_order(x[:, order], order[None]), x)


def test_per_document_balances_visible_pairs():
  n, t = 4, 256
  lengths = [150, 20, 30, 40]
  seg, pos = B.row_segments(lengths, t)
  mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None]) & (seg[:, None] > 0)
  for mode in ("sequence", "document"):
    order = S.row_layout(seg, t, n, mode)
    want = mask.sum(1)[order].reshape(n, -1).sum(1)          # pairs from the mask itself
    np.testing.assert_array_equal(S.rank_pairs(seg, pos, order, n), want)
  seq = S.imbalance(S.rank_pairs(seg, pos, S.row_layout(seg, t, n, "sequence"), n))
  doc = S.imbalance(S.rank_pairs(seg, pos, S.row_layout(seg, t, n, "document"), n))
  assert doc < 1.02 < 1.3 < seq


def test_layout_batch_composes_with_model_load_balance():
  n, t = 4, 64
  docs = _docs([20, 3, 17, 9, 6])
  b = B.to_lm_batch(docs, [[0, 1, 2], [3, 4]], t)
  host, orders, mode = S.layout_batch(b, n, "document")
  assert mode == "document"
  for r in range(2):
    want = S.per_document_order([l for _, l in B.row_documents(b.segment_ids[r])], t, n)
    np.testing.assert_array_equal(layout.load_balance(orders[r][None], n, 1)[0], want)
    np.testing.assert_array_equal(host.segment_ids[r], b.segment_ids[r][orders[r]])
  np.testing.assert_array_equal(S.restore_order(host.inputs, orders), b.inputs)
  seq, orders, _ = S.layout_batch(b, n, "sequence")
  np.testing.assert_array_equal(orders, np.broadcast_to(np.arange(t), (2, t)))
  direct, orders, _ = S.layout_batch(b, n, "document", model_balances=False)
  np.testing.assert_array_equal(orders[0], S.per_document_order([20, 3, 17], t, n))


def test_tile_costs_follow_the_kernel_block_classes():
  from kernels.flash_attention_mgpu import EMPTY, FULL, classify_blocks
  n, t, tile = 4, 512, 16
  seg, pos = B.row_segments([200, 9, 70, 33, 120, 5], t)
  model = S.TileModel(tile, tile, full=1.0, partial=3.0)
  for mode in ("sequence", "document"):
    order = S.row_layout(seg, t, n, mode)
    s, p = seg[order].reshape(n, -1), pos[order].reshape(n, -1)
    want = []
    for r in range(n):
      cls = np.concatenate([np.asarray(classify_blocks(True, s[r][None], s[k][None], p[r][None],
                                                       p[k][None], tile, tile))[0]
                            for k in range(n)], axis=1)
      want.append(np.sum(cls == FULL) + 3.0 * np.sum((cls != FULL) & (cls != EMPTY)))
    np.testing.assert_allclose(S.rank_tile_costs(seg, pos, order, n, model), want)


def test_adaptive_choice_prefers_sequence_for_many_short_documents():
  n, t = 8, 2048
  short = B.row_segments([8] * 256, t)
  long = B.row_segments([1536, 512], t)        # per-sequence: ranks 4..7 do 5x the work
  pick = lambda sp: S.choose_layout(sp[0][None], sp[1][None], n, S.TileModel(64, 64))
  assert pick(short)[0] == "sequence"
  assert pick(long)[0] == "document"


def test_adaptive_layout_of_rows_not_a_multiple_of_2n_is_refused_by_name():
  """T = 12 over 4 ranks: per-document sharding fits, per-sequence does not; "adaptive"
  raised from inside layout.load_balance ("axis 1 has length 12"), naming neither the
  choice nor the layout that works."""
  b = B.to_lm_batch([np.arange(1, 6), np.arange(1, 4)], [[0, 1]], 12)
  assert S.layout_batch(b, 4, "document")[2] == "document"
  with pytest.raises(ValueError, match=r"choose_layout: rows of T=12 tokens over n=4 ranks.*"
                                       r"multiple of 2\*4 \(use the 'document' layout"):
    S.layout_batch(b, 4, "adaptive")


# ----------------------------------------------------------------------------- cost model


def test_fit_recovers_coefficients_and_round_trips(tmp_path):
  l = np.array([64, 128, 256, 512, 1024, 2048])
  a, b, c = C.fit_attention(l, 3e-9 * l * l + 2e-6 * l + 1e-4)
  np.testing.assert_allclose([a, b, c], [3e-9, 2e-6, 1e-4], rtol=1e-6)
  d, e = C.fit_linear(l, 5e-5 * l)
  np.testing.assert_allclose([d, e], [5e-5, 0.0], atol=1e-12)
  # A negative unconstrained solution is replaced by the best non-negative one.
  assert min(C.fit_attention(l, 1e-9 * l * l - 1e-7 * l + 1e-3)) >= 0
  m = C.CostModel(a, b, c, d, e, meta={"x": [1, 2]})
  assert C.CostModel.load(m.save(str(tmp_path / "c.json"))) == m
  s1, s2 = C.Shape(64, 2, 1, 32, 128), C.Shape(128, 4, 2, 32, 256)
  big = m.scaled(s2.attention_width / s1.attention_width, 2.0)
  assert big.attn_quad == 2 * a and big.attn_const == c and big.lin_per_token == 2 * d
  assert m.total([10, 20]) == pytest.approx(m.attention([10, 20]) + m.linear(30))


@pytest.mark.parametrize("field,value", [("attn_quad", float("nan")), ("lin_per_token", -1.0),
                                         ("attn_lin", "2e-6"), ("lin_const", True)])
def test_cost_model_json_with_a_bad_coefficient_is_refused(tmp_path, field, value):
  """A NaN load wins no argmin comparison honestly (balanced_pack would put every document
  in bin 0 behind it), a negative one makes W negative, a string fails later in numpy: the
  file is refused on load, naming it, the field and the value."""
  d = C.CostModel(3e-9, 2e-6, 1e-4, 5e-5, 1e-3).to_dict()
  d[field] = value
  path = tmp_path / "c.json"
  path.write_text(json.dumps(d))
  with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: CostModel: {field}="):
    C.CostModel.load(str(path))
  path.write_text("[1, 2]")
  with pytest.raises(ValueError, match="holds a JSON list; expected an object"):
    C.CostModel.load(str(path))


def test_fit_cost_model_recovers_known_coefficients(monkeypatch):
  """The whole measure -> fit -> scale path on timings generated from known coefficients
  (the timed calls and the timer replaced): the fit recovers them, and the scaling
  multiplies them by the FLOP ratios worked out by hand."""
  a, b, c, d, e = 3e-9, 2e-6, 1e-4, 5e-5, 1e-3
  lengths, tokens = (16, 64, 128, 256, 512), (16, 64, 256, 1024)
  monkeypatch.setattr(C, "_attention_calls", lambda ls, *args: [("attn", l) for l in ls])
  monkeypatch.setattr(C, "_linear_calls", lambda ts, *args: [("linear", t) for t in ts])

  def fake_medians(calls, repeats):
    assert calls == [("attn", l) for l in lengths] + [("linear", t) for t in tokens]
    assert repeats == 2
    return [a * n * n + b * n + c if kind == "attn" else d * n + e for kind, n in calls]
  monkeypatch.setattr(C, "_interleaved_medians", fake_medians)
  shape, target = C.Shape(32, 2, 1, 16, 64), C.Shape(64, 4, 2, 16, 128)
  model = C.fit_cost_model(shape, target, lengths=lengths, tokens=tokens, repeats=2)
  # Attention scales by H*K: 4*16 / (2*16) = 2. Linear by the layer's matmul FLOPs per token:
  # 2 (2 D H K + 2 D G K + 3 D F) = 73728 vs 18432, a factor of 4.
  assert model.meta["attn_factor"] == 2.0 and model.meta["linear_factor"] == 4.0
  np.testing.assert_allclose([model.attn_quad, model.attn_lin, model.attn_const],
                             [2 * a, 2 * b, c], rtol=1e-6)
  np.testing.assert_allclose([model.lin_per_token, model.lin_const], [4 * d, e], rtol=1e-6)
  np.testing.assert_allclose(model.meta["attention"]["rel_err"], 0.0, atol=1e-6)
  np.testing.assert_allclose(model.meta["linear"]["rel_err"], 0.0, atol=1e-6)


def test_measure_and_fit_run_here():
  shape = C.Shape(32, 2, 1, 16, 64)
  model = C.fit_cost_model(shape, C.Shape(64, 4, 2, 16, 128), lengths=(16, 64),
                           tokens=(16, 64), repeats=1)
  assert model.attn_quad + model.attn_lin + model.attn_const > 0 and model.lin_per_token >= 0
  assert model.meta["attn_factor"] == 2.0 and len(model.meta["attention"]["seconds"]) == 2
  # The recorded fit errors are those of the unscaled coefficients on the measured times.
  m = model.meta
  unscaled = C.CostModel(model.attn_quad / 2, model.attn_lin / 2, model.attn_const,
                         model.lin_per_token / m["linear_factor"], model.lin_const)
  for l, t, err in zip((16, 64), m["attention"]["seconds"], m["attention"]["rel_err"]):
    assert t > 0 and err == pytest.approx((float(unscaled.doc_attention(l)) - t) / t, abs=1e-9)
  for n, t, err in zip((16, 64), m["linear"]["seconds"], m["linear"]["rel_err"]):
    assert t > 0 and err == pytest.approx((unscaled.linear(n) - t) / t, abs=1e-9)
  # The non-negative fit is the optimum: its weighted residual is no larger than that of
  # scipy's NNLS (Lawson-Hanson) on the same relative-error system.
  from scipy.optimize import nnls
  for x, t, coef in (
      (np.array([[l * l, l, 1.0] for l in (16, 64)]), m["attention"]["seconds"],
       [unscaled.attn_quad, unscaled.attn_lin, unscaled.attn_const]),
      (np.array([[n, 1.0] for n in (16, 64)]), m["linear"]["seconds"],
       [unscaled.lin_per_token, unscaled.lin_const])):
    w = 1.0 / np.asarray(t)
    _, best = nnls(x * w[:, None], np.asarray(t) * w)
    ours = np.linalg.norm((x * w[:, None]) @ np.asarray(coef) - np.asarray(t) * w)
    assert ours <= best + 1e-9
  f = C.flop_cost_model(shape)
  assert f.doc_attention(10) == 6 * 32 * 100


def test_length_dist_sample():
  dist = LengthDist(context=4096, median=100, sigma=0.5, tail_prob=0.1, tail_min=1000,
                    tail_alpha=1.5, min_len=8)
  x = dist.sample(20000, seed=3)
  np.testing.assert_array_equal(x, dist.sample(20000, seed=3))
  assert x.dtype == np.int64 and x.min() >= 8 and x.max() <= 4096
  # Body: log-normal with median 100 (90% of draws); tail: P(X > 2000) = 0.1 * 0.5^1.5.
  body = x[x < 1000]
  assert np.median(body) == pytest.approx(100, rel=0.05)
  assert np.mean(x > 2000) == pytest.approx(0.1 * 0.5 ** 1.5, rel=0.15)
  with pytest.raises(ValueError, match="min_len"):
    LengthDist(context=8, min_len=16)


# ----------------------------------------------------------------------------- corpus shape


def test_corpus_lengths_follow_the_pile_table():
  from llm.packing.lengths import PILE_TABLE1, CorpusLengths
  dist = CorpusLengths(context=131072)
  # Documents per component = effective size / mean document size; the mixture's mean
  # document is then Table 1's total: 1254.20 GiB over all documents = 5.91 KiB (published,
  # rounded), i.e. 5.91 * 1024 / 4 tokens at 4 bytes per token.
  assert len(PILE_TABLE1) == 22
  assert sum(g for _, g, _ in PILE_TABLE1) == pytest.approx(1254.20, abs=0.05)
  np.testing.assert_allclose(dist.weights()[:2] / dist.weights()[1],
                             [227.12 / 4.33 / (180.55 / 30.55), 1.0])
  assert float(dist.weights() @ dist.mean_tokens()) == pytest.approx(5.91 * 256, rel=2e-3)
  docs = dist.documents(400_000, seed=1)
  assert docs.mean() == pytest.approx(5.91 * 256, rel=0.05)
  assert np.median(docs) < 0.5 * docs.mean()                # most documents short
  assert docs.max() > 131072                                # a tail past the context
  # Pieces: each document cut into context-sized pieces, the remainder last; nothing lost.
  small = CorpusLengths(context=2048)
  whole = small.documents(1024, [7, 0])
  pieces = small.sample(10_000, 7)
  want = [p for l in whole.tolist() for p in [2048] * (l // 2048) + ([l % 2048] if l % 2048
                                                                     else [])]
  np.testing.assert_array_equal(pieces[:len(want)], want)
  assert pieces.max() == 2048 and pieces.min() >= 1
  scaled = CorpusLengths(context=131072, scale=1 / 64).sample(5000, 3)
  np.testing.assert_array_equal(
      scaled, np.maximum(np.round(CorpusLengths(context=131072).sample(5000, 3) / 64), 1))
  with pytest.raises(ValueError, match="scale=0"):
    CorpusLengths(scale=0)


# ----------------------------------------------------------------------------- work meter


def _pairs_by_hand(seg, pos, ranks_of_slot):
  """Per rank: sum over its real tokens of position + 1, in plain Python."""
  out = {}
  for s, p, r in zip(seg.tolist(), pos.tolist(), ranks_of_slot):
    out[r] = out.get(r, 0) + (p + 1 if s else 0)
  return [out.get(r, 0) for r in range(max(ranks_of_slot) + 1)]


def test_step_work_counts_known_rows():
  from llm.packing import meter as M
  cost = C.CostModel(attn_quad=1.0, attn_lin=0.0, attn_const=0.0, lin_per_token=0.5,
                     lin_const=2.0)
  # One 16-token document over 2 ranks. Balanced (chunks of 4: rank 0 positions 0-3, 12-15;
  # rank 1 4-11): 10 + 58 = 68 pairs each. Contiguous halves: 36 and 100.
  seg, pos = B.row_segments([16], 16)
  bal = M.step_work(seg[None], pos[None], 2, model_balances=True, cost=cost)
  np.testing.assert_array_equal(bal.pairs, [[68, 68]])
  flat = M.step_work(seg[None], pos[None], 2, model_balances=False, cost=cost)
  np.testing.assert_array_equal(flat.pairs, [[36, 100]])
  # The cost model's attention (l^2 = 256) split by pairs (of 136), plus 0.5 x 8 tokens + 2.
  np.testing.assert_allclose(flat.model, [[256 * 36 / 136 + 6, 256 * 100 / 136 + 6]])
  m = M.step_metrics(flat, n_layers=3)
  assert m["imbalance_cp"] == pytest.approx(100 / 68)
  assert m["model_step"] == pytest.approx(3 * (256 * 100 / 136 + 6))
  assert m["model_ideal"] == pytest.approx(3 * (256 / 2 + 6))
  assert m["tokens"] == 16 and m["imbalance_mb"] == 1.0


def test_step_work_matches_an_independent_count():
  """Two packed rows laid out per document for 4 ranks (the model balancing on entry): pairs,
  tokens and modelled times per (row, rank) against plain Python over the slots, and the
  step's imbalance numbers against numpy's max / mean."""
  from llm.packing import meter as M
  n, t = 4, 64
  docs = _docs([20, 3, 17, 9, 6, 8, 1])
  b = B.to_lm_batch(docs, [[0, 1, 2, 6], [3, 4, 5]], t)
  host, _, _ = S.layout_batch(b, n, "document")
  work = M.step_work(host.segment_ids, host.positions, n, model_balances=True, cost=COST)
  # The model's entry balancing: slot j of the rebalanced row is host slot
  # chunk_order[j // c] * c + j % c, chunks of c = t / 2n, order 0, 2n-1, 1, 2n-2, ...
  c = t // (2 * n)
  chunk_order = [k for i in range(n) for k in (i, 2 * n - 1 - i)]
  slots = [chunk_order[j // c] * c + j % c for j in range(t)]
  rank_of_host_slot = {s: j // (t // n) for j, s in enumerate(slots)}
  ranks = [rank_of_host_slot[s] for s in range(t)]
  for r in range(2):
    seg, pos = host.segment_ids[r], host.positions[r]
    np.testing.assert_array_equal(work.pairs[r], _pairs_by_hand(seg, pos, ranks))
    np.testing.assert_array_equal(
        work.tokens[r], [sum(1 for s, k in zip(seg, ranks) if s and k == q) for q in range(n)])
    # Cost: each document's a l^2 + b l + c split by the pairs a rank holds of it.
    lengths = {s: int(np.sum(seg == s)) for s in set(seg.tolist()) if s}
    for q in range(n):
      attn = 0.0
      for s, l in lengths.items():
        held = sum(p + 1 for ss, p, k in zip(seg.tolist(), pos.tolist(), ranks)
                   if ss == s and k == q)
        attn += float(COST.doc_attention(l)) * held / (l * (l + 1) / 2)
      tokens = int(work.tokens[r, q])
      assert work.model[r, q] == pytest.approx(attn + COST.lin_per_token * tokens
                                               + COST.lin_const)
  m = M.step_metrics(work, n_layers=2)
  rows, per_rank = work.pairs.sum(1), work.pairs.sum(0)
  assert m["imbalance_mb"] == pytest.approx(rows.max() / rows.mean())
  assert m["imbalance_cp"] == pytest.approx(per_rank.max() / per_rank.mean())
  assert m["imbalance_cp_row"] == pytest.approx(np.mean([p.max() / p.mean() for p in work.pairs]))
  # Per-document sharding balances better than the model's per-sequence chunks, here
  # 1.093 vs 1.288 (short documents cannot be cut evenly into 8 chunks).
  seq = M.step_work(b.segment_ids, b.positions, n, model_balances=True, cost=COST)
  assert m["imbalance_cp"] < 1.1 < 1.25 < M.step_metrics(seq, 2)["imbalance_cp"]


# ----------------------------------------------------------------------------- packed source


class _EvenLengths:
  """Document lengths that are multiples of 2n = 8 (every chunk of a document the same
  size, so each rank's share of a document can be written down)."""

  def sample(self, n, seed):
    rng = np.random.default_rng(seed)
    return 8 * np.minimum(rng.geometric(0.15, size=n), 16)


def _source(packing, layout, **kw):
  from llm.packing.source import PackedSource, PackingSpec
  args = dict(seq_len=128, batch_size=4, cp=4, cost=COST, n_layers=2, seed=5,
              tile_model=S.TileModel(8, 8))
  args.update(kw)
  return PackedSource(np.arange(5000) % 251, _EvenLengths(),
                      PackingSpec(packing=packing, layout=layout), **args)


@pytest.mark.parametrize("packing", ["original", "fixed", "wlb"])
def test_packed_source_resumes_and_keeps_documents_whole(packing):
  import itertools
  src = _source(packing, "document")
  steps = list(itertools.islice(src.steps(), 6))
  first = list(itertools.islice(src.batches(0), 6))
  again = next(_source(packing, "document").batches(4))
  for f in ("inputs", "targets", "mask", "positions", "segment_ids"):
    np.testing.assert_array_equal(getattr(again, f), getattr(first[4], f))
  for rows, batch in zip(steps, first):
    got = B.unpack_rows(batch)           # by segment id and position: any layout
    for r, row in enumerate(rows):
      assert sum(int(src.lengths_of([i])[0]) for i in row) <= 128
      assert len(got[r]) == len(row)
      for i, tok in zip(row, got[r]):
        np.testing.assert_array_equal(tok, src.document(i))


def test_per_document_ranks_hold_chunks_r_and_2n_minus_1_minus_r():
  """The ranks' tokens, as the model places the batch (load balancing on entry), together
  are the batch; rank r holds chunks r and 2N-1-r of every document, so its pairs are a sum
  written down from the lengths alone."""
  from llm.packing import meter as M
  n = 4
  src = _source("wlb", "document")
  batch = next(src.batches(0))
  seg = M.rank_tokens(batch.segment_ids, n, True)
  pos = M.rank_tokens(batch.positions, n, True)
  tok = M.rank_tokens(batch.inputs, n, True)
  rows = next(src.steps())
  work = M.step_work(batch.segment_ids, batch.positions, n, model_balances=True, cost=COST)
  for r, row in enumerate(rows):
    hand = np.zeros(n, np.int64)
    for s, i in enumerate(row, start=1):
      doc, l = src.document(i), len(src.document(i))
      c = l // (2 * n)
      for q in range(n):
        mine = (seg[r, q] == s)
        want = np.concatenate([np.arange(q * c, (q + 1) * c),
                               np.arange((2 * n - 1 - q) * c, (2 * n - q) * c)])
        np.testing.assert_array_equal(np.sort(pos[r, q][mine]), want)
        np.testing.assert_array_equal(tok[r, q][mine][np.argsort(pos[r, q][mine])], doc[want])
        hand[q] += int(np.sum(want + 1))
    np.testing.assert_array_equal(work.pairs[r], hand)
    assert np.sum(seg[r] != 0) == sum(len(src.document(i)) for i in row)   # nothing else


def test_packed_source_metrics_and_arguments():
  import itertools
  src = _source("wlb", "adaptive")
  for rows, batch in itertools.islice(zip(src.steps(), src.batches(0)), 3):
    m = src.step_metrics(batch)
    natural = B.to_lm_batch({i: src.document(i) for r in rows for i in r}, rows, 128)
    pick, _ = S.choose_layout(natural.segment_ids, natural.positions, 4, S.TileModel(8, 8))
    assert m["pack_layout_document"] == float(pick == "document")
    assert m["pack_tokens"] == sum(len(src.document(i)) for r in rows for i in r)
  assert set(m) == {"pack_imbalance_mb", "pack_imbalance_cp", "pack_imbalance_cp_row",
                    "pack_model_step", "pack_model_ideal", "pack_tokens", "pack_tile_step",
                    "pack_layout_document"} and len(src.records) == 3
  from llm.packing.source import PackingSpec
  with pytest.raises(ValueError, match="packing='best'"):
    PackingSpec(packing="best")
  with pytest.raises(ValueError, match="layout='document' needs cp > 1"):
    _source("wlb", "document", cp=1)
  with pytest.raises(ValueError, match="has .* tokens; expected 1..seq_len=64"):
    _source("wlb", "sequence", seq_len=64, cp=1).lengths_of([0])


def test_a_host_shard_is_its_rows_of_the_global_batch():
  """num_shards > 1 (one process of many): shard k yields rows [k B/n, (k+1) B/n) of the batch
  a single process builds, laid out as there; unmeasured batches' layouts are not kept
  without bound (a prefetching loader)."""
  import itertools
  whole = list(itertools.islice(_source("wlb", "document").batches(0), 3))
  for k in range(2):
    part = list(itertools.islice(_source("wlb", "document", shard_index=k,
                                         num_shards=2).batches(0), 3))
    for w, p in zip(whole, part):
      for f in ("inputs", "targets", "mask", "positions", "segment_ids"):
        np.testing.assert_array_equal(getattr(p, f), getattr(w, f)[2 * k:2 * k + 2])
  with pytest.raises(ValueError, match="shard 2 of 2 with batch_size=4: expected 0 <= shard"):
    _source("wlb", "document", shard_index=2, num_shards=2)
  with pytest.raises(ValueError, match="shard 0 of 3 with batch_size=4"):
    _source("wlb", "document", num_shards=3)
  from llm.packing import source
  with pytest.raises(ValueError, match="PackingSpec: layout='doc', expected one of"):
    source.PackingSpec(layout="doc")
  with pytest.raises(ValueError, match="PackingSpec: fixed_window=0, expected >= 1"):
    source.PackingSpec(fixed_window=0)
  with pytest.raises(ValueError, match=r"PackingSpec: wlb_queues=4, expected 0..3 \(one per"):
    source.PackingSpec(wlb_queues=4)
  with pytest.raises(ValueError, match=r"outlier_fractions=\(0.5, 0\), expected fractions"):
    source.PackingSpec(outlier_fractions=(0.5, 0), wlb_queues=1)
  with pytest.raises(ValueError, match="PackedSource: 100 tokens to cut documents from, fewer "
                     "than seq_len \\+ 1 = 129"):
    source.PackedSource(np.arange(100), None, source.PackingSpec(), seq_len=128, batch_size=4,
                        cost=COST)
  with pytest.raises(ValueError, match="seq_len=128 over cp=3 ranks; expected a multiple"):
    source.PackedSource(np.arange(1000), None, source.PackingSpec(), seq_len=128,
                        batch_size=4, cp=3, cost=COST)
  src = _source("original", "sequence", cp=1)
  kept = list(itertools.islice(src.batches(0), 70))
  assert len(src._layouts) == 64 and id(kept[-1]) in src._layouts
  assert src.step_metrics(kept[-1])["pack_layout_document"] == 0.0


@pytest.mark.parametrize("doc_context,cp_tile,tile", [(1024, 0, 16), (0, 0, 128), (1024, 40, 40)])
def test_from_run_scales_the_tile_model_like_the_documents(doc_context, cp_tile, tile):
  from core import config
  from llm.packing import source
  from llm.run_config import LMRunConfig
  run = config.build(LMRunConfig, text="t.txt", packing="wlb", cp_sharding="adaptive",
                     seq_len=128, batch_size=4, doc_context=doc_context, cp_tile=cp_tile)
  src = source.from_run(run, np.arange(1000), 4, n_layers=2, cost=COST)
  assert src.tile_model == S.TileModel(tile, tile)
  assert (src.spec.packing, src.spec.layout, src.seq_len, src.cp) == ("wlb", "adaptive", 128, 4)
  assert src.dist.context == (doc_context or 128)
