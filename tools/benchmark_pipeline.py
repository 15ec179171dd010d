"""`python tools/benchmark_pipeline.py ARGS` runs `lingvo-gpipe-bench ARGS`
(lingvo_gpipe/tools/benchmark_pipeline.py, installed with the package)."""

from lingvo_gpipe.tools import benchmark_pipeline

if __name__ == '__main__':
  benchmark_pipeline.RunAndExit()
