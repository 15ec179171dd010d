"""`python tools/max_model_size.py ARGS` runs `lingvo-gpipe-capacity ARGS`
(lingvo_gpipe/tools/max_model_size.py, installed with the package)."""

import sys

from lingvo_gpipe.tools import max_model_size

if __name__ == '__main__':
  sys.exit(max_model_size.main())
