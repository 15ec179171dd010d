"""GPipe pipeline parallelism; public names are re-exported by core.gpipe."""
