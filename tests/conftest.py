import os

import torch

# Without a GPU every Triton kernel runs in Triton's interpreter on CPU tensors.
# Set before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
