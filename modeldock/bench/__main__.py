"""`python -m modeldock.bench`: the same as `modeldock bench`."""

import sys

from modeldock.bench.cli import main

sys.exit(main())
