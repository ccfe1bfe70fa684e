"""Ready-made models: dense ``nn.Module``s written here (no torchvision), MobileNet v1 and v2
with ImageNet shapes; ``st.sparsify`` makes sparse copies of them (or of any model). See
README.md here.

Example:
    >>> import torch, sparsetorch as st
    >>> net = st.models.mobilenet_v2(width_mult=0.25, num_classes=10).eval()
    >>> net(torch.randn(1, 3, 64, 64)).shape
    torch.Size([1, 10])
"""
from .mobilenet import mobilenet_v1, mobilenet_v2

__all__ = ["mobilenet_v1", "mobilenet_v2"]
