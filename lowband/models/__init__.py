"""lowband.models."""
