"""The image-task fixtures of the quantization tests (defined in tests/quant/helpers.py)."""
from tests.quant.helpers import cnn_onnx, task, trained_cnn  # noqa: F401
