"""`python tools/build_cost.py ARGS` runs `lingvo-gpipe-build-cost ARGS`
(lingvo_gpipe/tools/build_cost.py, installed with the package)."""

import sys

from lingvo_gpipe.tools import build_cost

if __name__ == '__main__':
  sys.exit(build_cost.main())
