"""``python -m hybridflow <command> ...``: the ``hybridflow`` command."""

import sys

from hybridflow.cli import main

sys.exit(main())
