"""``python -m pagedmla`` runs the command line."""

import sys

from pagedmla.cli import main

sys.exit(main())
