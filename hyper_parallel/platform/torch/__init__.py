"""The PyTorch backend."""

from hyper_parallel.platform.torch.platform import TorchPlatform

__all__ = ["TorchPlatform"]
