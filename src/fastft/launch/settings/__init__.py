"""The launcher's configuration: ``fastft run``'s flags and their bounds, and the environment each worker starts with. Pure; no torch."""
