"""Fail when a test outside .ci/allowed-skips was skipped (or when no skip record was written).

    python .ci/check_skips.py SKIPS_JSONL .ci/allowed-skips

SKIPS_JSONL is what tests/conftest.py writes when LOWBAND_SKIPS_FILE is set: one JSON object per
skipped test, ``{"nodeid", "reason"}``. Allow-list lines are ``NODEID_GLOB  # why``.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path


def main(skips_path: str, allowed_path: str) -> int:
    skips_file = Path(skips_path)
    if not skips_file.exists():  # the conftest hook did not run: the check would pass vacuously
        print(f"check_skips: {skips_file} was not written (tests/conftest.py hook missing?)")
        return 1
    skips = [json.loads(line) for line in skips_file.read_text().splitlines() if line.strip()]
    allowed = [
        line.split("#", 1)[0].strip() for line in Path(allowed_path).read_text().splitlines()
    ]
    allowed = [a for a in allowed if a]
    for s in skips:
        print(f"SKIPPED {s['nodeid']}: {s['reason']}")
    bad = [s for s in skips if not any(fnmatch.fnmatchcase(s["nodeid"], a) for a in allowed)]
    if bad:
        print(f"check_skips: {len(bad)} skip(s) not in {allowed_path}:")
        for s in bad:
            print(f"  {s['nodeid']}: {s['reason']}")
        return 1
    print(f"check_skips: {len(skips)} skip(s), all allowed")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
