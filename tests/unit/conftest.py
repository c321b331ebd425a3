"""Unit-test settings.

Hypothesis's per-example deadline (200 ms) is a wall-clock bound: on a loaded
2-core runner it fails correct code. Properties are checked without it; how
fast things run is the benchmarks' business.
"""

from hypothesis import settings

settings.register_profile("binbatch", deadline=None)
settings.load_profile("binbatch")
