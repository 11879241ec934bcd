"""``python -m kvserve ...``: the same as the ``kvserve`` console script."""

import sys

from kvserve.cli import main

sys.exit(main())
