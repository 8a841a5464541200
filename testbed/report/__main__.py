import sys

from testbed.report import main

sys.exit(main())
