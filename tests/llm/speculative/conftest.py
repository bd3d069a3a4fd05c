"""Shared fixtures: a small-vocabulary target and a draft head distilled for it through
core.train (checkpointed, then loaded back), used by the decoding tests."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from core import mesh as mesh_lib
from core import train as train_lib
from llm.config import get_config
from llm.speculative import distill
from llm.train_lib import OptimConfig
from tests.llm.test_model import make_model

V = 8
CFG = get_config("tiny", vocab_size=V)
STEPS = 60


@pytest.fixture(scope="session")
def target():
  return make_model(CFG)[0]


@pytest.fixture(scope="session")
def sequences(target):
  """Sequences the target samples from 32 random 3-token prompts: 112 train, 16 eval."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, V, 3).tolist() for _ in range(32)]
  return distill.generate_sequences(target, 128, 32, prompts=prompts, batch_size=128)


@pytest.fixture(scope="session")
def distilled(target, sequences, tmp_path_factory):
  """(task, train summary, workdir, first logged train metrics)."""
  tokens, mask = sequences
  workdir = str(tmp_path_factory.mktemp("distill"))
  mesh = mesh_lib.make_mesh("data:1", devices=jax.devices()[:1])
  task = distill.DistillTask(target, OptimConfig(peak_lr=1e-2, warmup_steps=10,
                                                 total_steps=STEPS, weight_decay=0.0), mesh)
  train_src = distill.SequenceSource(tokens[:112], mask[:112], 16)
  eval_src = distill.SequenceSource(tokens[112:], mask[112:], 16, split="eval")
  out = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0),
                        train_lib.TrainConfig(workdir=workdir, steps=STEPS, log_every=10,
                                              tensorboard=False))
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    first = json.loads(f.readline())
  return task, out, workdir, first


@pytest.fixture(scope="session")
def draft(distilled):
  return distill.load_draft(distilled[2], CFG)
