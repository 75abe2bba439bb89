"""`python -m cluster.cli` runs the `hybridserve` command."""

import sys

from cluster.cli.main import main

sys.exit(main())
