"""The jobs a trainer process runs: training loop, checkpoints, evaler, export.

`lingvo_gpipe.trainer` (the `gpipe_trainer` entry point) parses the flags and
drives these modules; each can also be used from Python on its own.
"""
