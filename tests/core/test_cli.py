"""core.cli.run: a data or settings error ends in one `error: ...` line and status 2 (the
traceback only with --verbose_errors, Grain's worker errors included), a bug keeps its
traceback, and known noise is dropped. Entry points run in fresh processes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from core import cli, errors
from rec import configs
from tests import cpu_env
from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(body: str, *args: str, cwd=REPO) -> subprocess.CompletedProcess:
  """Runs `cli.run(main)` with `main` defined by `body` (indented into it)."""
  code = ("import sys\nfrom core import cli\n\ndef main(argv):\n"
          + textwrap.indent(textwrap.dedent(body), "  ")
          + "\nif __name__ == '__main__':\n  cli.run(main)\n")
  return forkserver.run([sys.executable, "-c", code, *args], fork=True, cwd=cwd, capture_output=True,
                        text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu",
                                 PYTHONPATH=cpu_env.python_path(REPO)))


def _in_process(main, *args, capsys):
  """cli.run(main) here (no new process): (exit status, stdout, stderr)."""
  with pytest.raises(SystemExit) as e:
    cli.run(main, argv=["probe", *args])
  out = capsys.readouterr()
  return e.value.code, out.out, out.err


def test_user_errors_end_in_one_line_with_status_2(capsys):
  def data_error(argv):
    print("working")
    raise errors.UserError("data.txt:7: field label = '2'; expected 0 or 1")
  code, out, err = _in_process(data_error, capsys=capsys)
  assert code == 2 and out == "working\n"
  assert err == "error: data.txt:7: field label = '2'; expected 0 or 1\n"
  # a settings check that raises ValueError in the project's own code
  code, _, err = _in_process(lambda argv: configs.RecRunConfig(
      train=configs.RecTrainConfig(learning_rate=-1.0)).validate(),
                             capsys=capsys)
  assert code == 2 and err == "error: --learning_rate=-1.0: expected a finite learning rate > 0\n"
  # sys.exit with a message (the entry points' own stops)
  code, _, err = _in_process(lambda argv: sys.exit("train_rec: --resume needs --workdir"),
                             capsys=capsys)
  assert code == 2 and err == "error: train_rec: --resume needs --workdir\n"
  # a path that is not there, whoever opened it
  from rec.data import criteo
  code, _, err = _in_process(lambda argv: criteo.CriteoSource("/nonexistent/train.txt", 2),
                             capsys=capsys)
  assert code == 2 and err == ("error: /nonexistent/train.txt: CriteoSource: data file does not "
                               "exist\n")
  code, _, err = _in_process(lambda argv: os.path.getsize("/nonexistent/w.bin"), capsys=capsys)
  assert code == 2 and err == "error: /nonexistent/w.bin: No such file or directory\n"
  # the traceback on request, the line still last
  code, _, err = _in_process(data_error, "--verbose_errors", capsys=capsys)
  assert code == 2 and "Traceback (most recent call last)" in err
  assert err.strip().splitlines()[-1] == "error: data.txt:7: field label = '2'; expected 0 or 1"
  _in_process(data_error, "--noverbose_errors", capsys=capsys)



def test_a_bad_flag_is_a_settings_error(capsys):
  """An unknown flag or a value its flag refuses ends as every settings error does: one
  `error: ...` line and status 2, main never run (absl's parser: two FATAL lines, status 1)."""
  ran = []
  code, out, err = _in_process(ran.append, "--no_such_flag=1", capsys=capsys)
  assert code == 2 and out == "" and not ran
  assert err.startswith("error: Unknown command line flag 'no_such_flag'")
  assert len(err.splitlines()) == 1
  code, _, err = _in_process(ran.append, "--verbose_errors=maybe", capsys=capsys)
  assert code == 2 and not ran and len(err.splitlines()) == 1
  assert err.startswith("error: flag --verbose_errors=maybe: ")


def test_a_stop_on_request_and_a_failed_checkpoint_write_end_in_one_line(capsys):
  from core import checkpoint as ckpt_lib
  from core import train as train_lib

  def stopped(argv):
    print("step 10/100")
    raise train_lib.Interrupted(10, 15)   # SIGTERM during training
  code, out, err = _in_process(stopped, capsys=capsys)
  assert code == 143 and out == "step 10/100\n"
  assert err == "stopped at step 10; checkpoint 10 kept; continue with --resume\n"
  code, _, err = _in_process(lambda argv: (_ for _ in ()).throw(train_lib.Interrupted(3, 2)),
                             capsys=capsys)
  assert code == 130 and err.endswith("stopped at step 3; checkpoint 3 kept; continue with "
                                      "--resume\n")
  full = ValueError("OUT_OF_RANGE: Error writing \"a/0\": Failed writing: \"/w/checkpoints/"
                    "5.orbax-checkpoint-tmp/state/d/1\": x [os_error_code='27']")
  line = ckpt_lib.write_error("/w/checkpoints", 5, full)

  def full_disk(argv):
    raise line
  code, _, err = _in_process(full_disk, capsys=capsys)
  assert code == 2 and err == (
      "error: checkpoint /w/checkpoints/5: writing /w/checkpoints/5.orbax-checkpoint-tmp/state/"
      "d/1 failed: File too large (EFBIG); expected room for the checkpoint on that file system "
      "(free space, a file-size limit: ulimit -f) or another --workdir\n")
  assert ckpt_lib.write_error("/w", 5, ValueError("a bug")) is None   # keeps its traceback


def test_a_workdir_flag_is_held_for_the_run(tmp_path, capsys):
  from absl import flags as absl_flags
  from core import workdir as workdir_lib
  assert "workdir" not in absl_flags.FLAGS
  absl_flags.DEFINE_string("workdir", None, "probe")   # as an entry point defines it
  seen = {}

  def main(argv):
    seen["held"] = workdir_lib.holds(str(tmp_path / "w"))
  try:
    with pytest.raises(SystemExit):
      cli.run(main, argv=["probe", f"--workdir={tmp_path / 'w'}"])
  finally:
    delattr(absl_flags.FLAGS, "workdir")
  assert seen["held"]
  workdir_lib.release(str(tmp_path / "w"))   # at exit in a real run


def test_bugs_keep_their_traceback():
  out = _run("""
      import json
      json.loads("{")          # a ValueError raised inside a library: a bug, not a message
  """)
  assert out.returncode == 1 and "Traceback (most recent call last)" in out.stderr
  assert "JSONDecodeError" in out.stderr


def test_is_user_error():
  assert cli.is_user_error(errors.UserError("x"))
  try:
    configs.RecRunConfig(train=configs.RecTrainConfig(batch_size=0)).validate()
  except ValueError as e:
    assert cli.is_user_error(e) and cli.error_line(e) == "error: --batch_size=0: expected >= 1"
  try:
    int("x")
  except ValueError as e:
    assert not cli.is_user_error(e)   # raised where no project file raises it
  try:
    np.zeros((2, 3)).reshape(5)
  except ValueError as e:
    assert not cli.is_user_error(e)
  assert errors.expected("f.txt:3", "39 fields", "40").args == ("f.txt:3: 39 fields; expected 40",)


def test_a_grain_worker_error_is_the_last_line(tmp_path):
  """A corrupt shard found in a Grain worker process: the reader's own message, last."""
  from rec.data import criteo_bin
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 2, 4096).astype(np.uint8)
  labels[1000] = 7
  criteo_bin.write_arrays(str(tmp_path / "bin"), {"train": (
      rng.random((4096, 13), np.float32), rng.integers(0, 50, (4096, 26)).astype(np.int32),
      labels)}, [50] * 26)
  out = _run(f"""
      from rec.data import criteo_bin
      src = criteo_bin.CriteoBinSource({str(tmp_path / 'bin')!r}, "train", 256, shuffle=False,
                                       repeat=False, num_workers=2, verify=False)
      for b in src.batches():
        pass
  """)
  assert out.returncode == 2, out.stderr[-3000:]
  want = (f"error: {tmp_path}/bin/train/arrays-0000.label.npy row 1000: label 7; expected 0 or "
          "1: a corrupt shard")
  assert out.stderr.strip().splitlines()[-1] == want, out.stderr[-3000:]
  assert "Grain" not in out.stderr and "leaked" not in out.stderr


def test_known_noise_is_dropped(caplog):
  cli.quiet_known_noise()
  log = logging.getLogger("jax._src.xla_bridge")
  with caplog.at_level(logging.INFO, logger="jax._src.xla_bridge"):
    log.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
    log.info("Platform 'cpu' is experimental")
  assert [r.getMessage() for r in caplog.records] == ["Platform 'cpu' is experimental"]
  assert "ignore::UserWarning:multiprocessing.resource_tracker" in sys.warnoptions


def test_progress_names_its_unit():
  from core import train
  p = train.Progress(100, 0, "tokens")
  p.begin(1)
  p.examples = 5000
  assert " tokens/s | " in p.line(10, {"loss": 1.0}) and "ex/s" not in p.line(10, {})
  from llm import train_lib
  assert train_lib.LMTask.example_unit == "tokens"
