"""bridge: sync JAX-sharded weights into PyTorch ranks over torch.distributed.

Importing this package never imports jax: inference processes run torch only.
"""
