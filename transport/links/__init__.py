"""transport.links."""
