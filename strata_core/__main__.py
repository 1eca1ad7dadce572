"""``python -m strata_core`` runs the ``strata`` command."""

import sys

from strata_core.cli import main

sys.exit(main())
