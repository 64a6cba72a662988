"""fastft for JAX (``pip install 'fastft[jax]'``): the same transaction, rollback, heal,
spares and durable tier for JAX training. See :mod:`fastft.jax.runtime` and
``docs/jax.md``."""

from fastft.jax.runtime import JaxRuntime, init
from fastft.jax.transaction import JaxTransaction

__all__ = ["JaxRuntime", "JaxTransaction", "init"]
