"""core.train: an evaluation that fails (a corrupt eval shard, a malformed eval line) does not
lose the training before it: the state is saved first, and a resume continues from it."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from core import checkpoint as ckpt_lib
from core import train as train_lib
from core.errors import UserError
from rec import configs


def test_a_failing_eval_saves_the_training_first(tmp_path, capsys):
  cfg = configs.make_run(model="logreg", data="synthetic", num_rows=100, mesh="-1",
                             batch_size=64, eval_batch_size=64, eval_batches=2, sharding="dp")
  task, train_src, eval_src, _, _ = configs.build_run(cfg, jax.devices()[:1])

  def bad_eval():
    for b in itertools.islice(eval_src.batches(0), 1):
      yield b
    raise UserError("valid/x-0000.label.npy row 5: label 7; expected 0 or 1: a corrupt shard")

  loop = dict(workdir=str(tmp_path), steps=6, eval_every=4, log_every=2, tensorboard=False)
  with pytest.raises(UserError, match="label 7"):
    train_lib.train(task, train_src.batches, bad_eval, train_lib.TrainConfig(**loop))
  assert "evaluation at step 4 failed; the training so far is saved" in capsys.readouterr().out
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  assert ckpt.all_steps() == [4]
  ckpt.close()
  # the saved state continues with a good eval set, as a run whose eval never failed
  out = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0),
                        train_lib.TrainConfig(**loop, resume=True))
  assert out["step"] == 6 and out["finished"]
  straight = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0),
                             train_lib.TrainConfig(**dict(loop, workdir=str(tmp_path / "s"))))
  assert out["eval"] == straight["eval"] and 0 < out["eval"]["auc"] < 1
  for a, b in zip(jax.tree.leaves(jax.device_get(out["state"])),
                  jax.tree.leaves(jax.device_get(straight["state"]))):
    np.testing.assert_array_equal(a, b)
