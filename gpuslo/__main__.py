import sys

from gpuslo.cli import main

sys.exit(main())
