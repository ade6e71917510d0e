import sys

from hybridflow.report import main

sys.exit(main())
