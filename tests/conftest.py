import os
import sys

# Triton kernels run in the interpreter on CPU: set before anything imports triton (whatever test runs first).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests run from a checkout too (the package need not be installed).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "src"))
