"""`python -m flashsuite.dispatch` is the `flashsuite` command."""

import sys

from flashsuite.dispatch.cli import main

sys.exit(main())
