"""An independent PyTorch model (GPT-2's block and the modern one): ``model`` and
``layers`` import torch at their top, so only the benchmark's PyTorch contestants and the
tests load them."""
