"""The simulator: the in-memory Transport and the synchronous loop over the runtime's round."""
