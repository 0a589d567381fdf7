# lowband on CPU: training sites, the coordinator, the Flower SuperLink/SuperNodes, the report.
#   docker build -t lowband .
# Used by docker-compose.yml (the multi-site demo); see README.md.
#
# Users build it unchanged. A machine without a registry or the PyTorch index builds the same
# file through build arguments only (scripts/compose_demo.sh does this):
#   BASE         an imported Debian image with python3, python3-venv and iproute2
#   TORCH_INDEX  where torch==2.13.0 comes from when WHEELS holds no torch wheel
#   WHEELS       a directory of the build context searched first (e.g. the CPU torch wheel)
#   --secret id=ca,src=CA.pem   an extra CA bundle for pip, never stored in a layer
# No `# syntax=` line on purpose: the builtin BuildKit frontend (Docker >= 20.10) has
# RUN --mount, and fetching a frontend image would need a registry.
ARG BASE=python:3.11-slim

# The wheel directory as a stage of its own: RUN --mount takes no build arguments, COPY does.
# Only mounted below, never a layer of the image.
FROM scratch AS wheels
ARG WHEELS=docker/wheels
COPY ${WHEELS}/ /

FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

# A venv on PATH: Debian's system python refuses pip installs (PEP 668), python:3.11-slim's
# does not care; `python` then means the venv's on both bases.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# iproute2: `tc` for the per-site egress shaping done by docker/shape-egress.sh (a debootstrap
# base already has it; python:3.11-slim does not).
RUN command -v tc >/dev/null \
    || (apt-get update \
        && apt-get install -y --no-install-recommends iproute2 \
        && rm -rf /var/lib/apt/lists/*) \
    && python3 -m venv /opt/venv

# The user every command runs as: docker/shape-egress.sh shapes the egress as root (tc needs
# CAP_NET_ADMIN), then drops to it with setpriv (util-linux, in every Debian base).
RUN groupadd --system --gid 10001 lowband \
    && useradd --system --uid 10001 --gid lowband --create-home --home-dir /home/lowband \
        --shell /usr/sbin/nologin lowband \
    && mkdir -p /runs && chown lowband:lowband /runs
ENV LOWBAND_USER=lowband \
    LOWBAND_DATA=/runs

WORKDIR /opt/lowband

# CPU-only torch first: the default index resolves torch to the CUDA build (several GB).
# constraints.txt then pins the same version for everything after. The wheel directory and the
# CA bundle are mounted for this step only, so neither ends up in the image.
RUN --mount=type=bind,from=wheels,target=/wheels \
    --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    if ls /wheels/torch-2.13.0* >/dev/null 2>&1; then \
        pip install --no-index --find-links /wheels torch==2.13.0; \
    else \
        pip install torch==2.13.0 --index-url "$TORCH_INDEX"; \
    fi

# Dependencies before the code, so that editing the code does not reinstall them: the list is
# read from pyproject.toml (tomllib, Python >= 3.11).
COPY pyproject.toml constraints.txt ./
RUN --mount=type=bind,from=wheels,target=/wheels \
    --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + p["optional-dependencies"]["train"] \
+ p["optional-dependencies"]["flower"] + ["setuptools>=68", "wheel"]))' > /tmp/requirements.txt \
    && pip install --find-links /wheels -c constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY README.md LICENSE ./
COPY lowband/ lowband/
COPY transport/ transport/
COPY diloco/ diloco/
COPY edge/ edge/
COPY cli/ cli/
# Everything it needs is installed above: no index, no build isolation.
RUN pip install --no-deps --no-build-isolation --no-index -c constraints.txt ".[train,flower]" \
    && python -c "import torch, cli; assert not torch.version.cuda, 'CUDA torch slipped in'"

COPY examples/ examples/
COPY docker/shape-egress.sh docker/compare.py docker/site-config.json docker/
RUN chmod +x docker/shape-egress.sh

# Every container shapes its own egress from RATE/DELAY (if set), then runs the command as
# LOWBAND_USER, never as root.
ENTRYPOINT ["/opt/lowband/docker/shape-egress.sh"]
CMD ["lowband", "--help"]
