"""The JAX tier's shared names (a module of its own: ``conftest`` is not importable by
name when several directories have one)."""

JAX_DEMO = "fastft.demo.train_jax"
