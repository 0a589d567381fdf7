"""diloco (top-level package): Streaming DiLoCo and a DDP baseline over any Communicator."""
