"""ClientApp: H/P inner steps per round, codec-encoded pseudo-gradient replies."""

from diloco.flower.client import make_client_app

app = make_client_app()
