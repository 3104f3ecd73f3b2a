"""Calibration (a tool over the core): record post-RoPE K/V ranges on long samples into a scales file.

- :mod:`.calibrate`: the observing cache, chunked prefill, scales from statistics, the position-bucket report.
- :mod:`.data`: calibration text from local files (JSON/parquet through `datasets`, streamed) or a `datasets` name,
  packed into fixed-length samples.
"""
