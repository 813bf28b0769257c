"""``python -m mt ...``: the ``mt`` command, for environments without its script on PATH."""

import sys

from mt.cli.main import main

sys.exit(main())
