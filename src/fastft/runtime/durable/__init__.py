"""The durable tier (``--checkpoint-dir``): checkpoints on disk (written, verified,
loaded), the writer process, and when a commit hands its state to it."""
