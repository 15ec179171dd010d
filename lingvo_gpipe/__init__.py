"""lingvo_gpipe: GPipe pipeline parallelism for TensorFlow 2, Lingvo style."""

import importlib.util as _importlib_util

# TensorFlow comes as an extra (CPU-only and GPU machines need different
# builds), so a plain `pip install` lacks it: say which extra to install
# instead of failing later with "No module named 'tensorflow'". Only looked
# up, not imported: `pipeline.balance` runs without TensorFlow.
if _importlib_util.find_spec('tensorflow') is None:
  raise ImportError(
    'lingvo_gpipe needs TensorFlow, which comes with an extra: pip install '
    '"lingvo_gpipe[cpu]" (or "lingvo_gpipe[gpu]" on a GPU machine; in a '
    'checkout: pip install -e ".[cpu]").'
  )
