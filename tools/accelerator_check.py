"""`python tools/accelerator_check.py ARGS` runs
`lingvo-gpipe-accelerator-check ARGS` (lingvo_gpipe/tools/accelerator_check.py,
installed with the package)."""

import sys

from lingvo_gpipe.tools import accelerator_check

if __name__ == '__main__':
  sys.exit(accelerator_check.main())
