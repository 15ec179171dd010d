"""`python tools/inspect_model.py ARGS` runs `lingvo-gpipe-inspect ARGS`
(lingvo_gpipe/tools/inspect_model.py, installed with the package)."""

import sys

from lingvo_gpipe.tools import inspect_model

if __name__ == '__main__':
  sys.exit(inspect_model.main())
