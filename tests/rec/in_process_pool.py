"""`rec.data.criteo_bin`'s conversion units run in the test's own process."""

import importlib


class InProcessPool:
  """`convert`'s worker pool run in this process (monkeypatched module settings reach it)."""

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False

  imap_unordered = staticmethod(map)


def use(monkeypatch) -> None:
  """Converts `criteo_bin.convert`'s units in this process instead of spawned worker
  processes (each spawn imports the project anew)."""
  monkeypatch.setattr(importlib.import_module("rec.data.criteo_bin.convert"), "_pool",
                      lambda workers: InProcessPool())
