"""`python -m jaxbatch.cli ...`: the same as the `jaxbatch` console script."""

import sys

from jaxbatch.cli import main

sys.exit(main())
