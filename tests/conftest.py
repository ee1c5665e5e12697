import os
import sys

# Tests run from a checkout too (the package need not be installed).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "src"))
