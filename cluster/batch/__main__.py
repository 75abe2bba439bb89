"""`python -m cluster.batch`: the `hybridserve batch` command (`cluster.cli.batch`)."""

import sys

from cluster.cli.batch import main

sys.exit(main())
