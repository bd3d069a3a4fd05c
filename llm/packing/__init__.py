"""Document packing for long-context training: WLB-LLM (arXiv 2503.17924).

  cost.py      the micro-batch workload model W = sum_docs (a l^2 + b l + c) + d T + e, fitted
               from measured attention / linear-op times (any backend), saved as JSON
  packers.py   original (loader-order) packing, fixed-length greedy balancing over windows of
               global batches, WLB-LLM's variable-length packing with outlier queues
  batch.py     micro-batches -> LMBatch rows with segment ids and positions (and back)
  cp_shard.py  per-sequence vs per-document context-parallel layouts, rank workloads, the
               adaptive per-batch choice (tile model of a block-skipping kernel)
  lengths.py   synthetic document lengths with a long tail: log-normal body + Pareto tail
               (free parameters), or the Pile's shape (CorpusLengths, arXiv 2101.00027 Table 1)
  source.py    PackedSource: a resumable LMBatch source packing a document stream with any
               packer and CP layout, for `experiments.train_lm --packing`
  meter.py     attention work per micro-batch and CP rank of the batch the devices receive,
               imbalance and the cost model's step time

The paper's Table 2 and CP comparison: `python -m experiments.wlb_packing`; in training:
`python -m experiments.train_lm --packing=wlb --cp_sharding=adaptive`.
"""

from llm.packing.batch import row_documents, row_segments, to_lm_batch, unpack_rows
from llm.packing.cost import CostModel, Shape, fit_cost_model, flop_cost_model
from llm.packing.cp_shard import (TileModel, choose_layout, layout_batch, per_document_order,
                                  per_sequence_order, restore_order)
from llm.packing.lengths import CorpusLengths, LengthDist
from llm.packing.source import PackedSource, PackingSpec
from llm.packing.packers import (FixedGreedyPacker, WLBPacker, balanced_pack, original_packing,
                                 simulate)

__all__ = ["CorpusLengths", "CostModel", "FixedGreedyPacker", "LengthDist", "PackedSource",
           "PackingSpec", "Shape", "TileModel", "WLBPacker",
           "balanced_pack", "choose_layout", "fit_cost_model", "flop_cost_model", "layout_batch",
           "original_packing", "per_document_order", "per_sequence_order", "restore_order",
           "row_documents", "row_segments", "simulate", "to_lm_batch", "unpack_rows"]
