"""`python tools/plan.py ARGS` runs `lingvo-gpipe-plan ARGS`
(lingvo_gpipe/tools/plan.py, installed with the package)."""

import sys

from lingvo_gpipe.tools import plan

if __name__ == '__main__':
  sys.exit(plan.main())
