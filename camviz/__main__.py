"""``python -m camviz`` runs the command line."""

import sys

from camviz.cli import main

sys.exit(main())
