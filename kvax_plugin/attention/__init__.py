"""The attention op: block mask, reference, JAX and Triton backends, sharding."""
