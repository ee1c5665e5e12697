"""`python -m automp.protect MODEL.onnx -o OUT.onnx ...`: the same as `automp protect`."""
import sys

from automp.protect.cli import main

sys.exit(main())
