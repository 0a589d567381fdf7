"""ServerApp: DiLoCoStrategy rounds, server-side evaluation, metrics and checkpoints."""

from diloco.flower.server import make_server_app

app = make_server_app()
