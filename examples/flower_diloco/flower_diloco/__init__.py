"""Flower DiLoCo app: the ServerApp and ClientApp of lowband (diloco.flower)."""
