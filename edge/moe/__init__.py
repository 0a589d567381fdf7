"""edge.moe."""
