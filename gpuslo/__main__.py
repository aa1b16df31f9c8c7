import sys

from gpuslo.app.cli import main

sys.exit(main())
