"""``python -m nextoken ...``: the same as the ``nextoken`` command."""

import sys

from nextoken.cli import main

sys.exit(main())
