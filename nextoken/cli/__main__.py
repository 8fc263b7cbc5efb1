"""``python -m nextoken.cli``: the command line."""

import sys

from nextoken.cli import main

sys.exit(main())
