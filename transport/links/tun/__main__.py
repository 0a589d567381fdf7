"""``python -m transport.links.tun --calibrate [--json]``: measure the emulator."""

import sys

from transport.links.tun.calibrate import main

sys.exit(main())
