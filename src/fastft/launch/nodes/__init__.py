"""Node liveness: the node lease, its renewer and beats, and what an agent does when a node is lost or returns."""
