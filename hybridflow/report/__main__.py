"""``python -m hybridflow.report RUN_DIR``: the same as ``hybridflow report RUN_DIR``."""

import sys

from hybridflow.report import main
from hybridflow.validation import run_command, split_debug_flag

debug, arguments = split_debug_flag(sys.argv[1:])
sys.exit(run_command(lambda: main(arguments), debug))
