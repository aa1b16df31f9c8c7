import sys

from gpuslo.app.entry import main

sys.exit(main())
