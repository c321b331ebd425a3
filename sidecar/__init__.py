"""binbatch sidecar: the scheduling core, its simulator and benchmarks."""
