import sys

from automp.cli import main

sys.exit(main())
