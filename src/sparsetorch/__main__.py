"""``python -m sparsetorch ...`` runs the command line (see ``sparsetorch.cli``)."""
import sys

from .cli import main

sys.exit(main())
