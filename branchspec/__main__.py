import sys

from branchspec.cli import main

sys.exit(main())
