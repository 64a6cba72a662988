"""The state a step changes and a heal sends: the registry (model, optimizer, the user's
objects), its tree and wire formats, the heal transfer, kept gradients, the shards of
the global batch, and resumable data (``fastft.Batches``)."""
