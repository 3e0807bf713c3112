"""`python -m services.cli`: the `corestream` command without its console script."""

import sys

from services.cli.main import main

sys.exit(main())
