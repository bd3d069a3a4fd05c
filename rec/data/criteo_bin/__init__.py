"""Criteo click logs converted once into memory-mapped numpy shards, and a Grain reader of them.

  format.py   the on-disk layout: manifest, column files per shard, unit markers with
              CRC-32 checksums; load_manifest, write_arrays, fingerprints
  convert.py  convert(src, dst): any layout `criteo.criteo_layout` reads, in worker
              processes, resumable (vocabulary count included), hashed or vocabulary ids
  source.py   CriteoBinSource: checksums verified on open, Grain random access, block
              shuffle, per-process shares of each batch, worker processes

`from rec.data import criteo_bin` gives the names of all three.
"""

from rec.data.criteo_bin.convert import (UNIT_BYTES, Unit, _count_unit, _die_with_parent,
                                         convert, plan_units, source_layout)
from rec.data.criteo_bin.format import (COLUMNS, FORMAT, ROWS_PER_SHARD, VERSION,
                                        conversion_settings, data_fingerprint, file_crc32,
                                        load_manifest, settings_fingerprint, write_arrays)
from rec.data.criteo_bin.source import CriteoBinSource

__all__ = ["COLUMNS", "FORMAT", "ROWS_PER_SHARD", "UNIT_BYTES", "VERSION", "CriteoBinSource",
           "Unit", "conversion_settings", "convert", "data_fingerprint", "file_crc32",
           "load_manifest", "plan_units", "settings_fingerprint", "source_layout",
           "write_arrays"]
