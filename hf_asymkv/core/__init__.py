"""The library a user imports: quantization math, storage, the cache, attention, scales and their files.

Nothing here imports the tools (calibration, evaluations, benchmarks, publishing, the command line);
``tests/core/test_layout.py`` holds the line.
"""
