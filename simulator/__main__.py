"""``python -m simulator``: see simulator.cli."""

import sys

from simulator.cli import main

sys.exit(main())
