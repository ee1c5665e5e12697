import torch

# Where int4 runs in this test process: tests/conftest.py turns the Triton interpreter on only on a machine without a
# GPU, and int4 on the CPU needs it (automp.llm.quantize.check_backend). So int4 tests run on CUDA when it exists.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
