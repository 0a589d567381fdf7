"""lowband.diloco: Streaming DiLoCo training (and a DDP baseline) over any Communicator."""
