# lowband on CPU: training sites, the coordinator, the Flower SuperLink/SuperNodes, the report.
#   docker build -t lowband .
# Used by docker-compose.yml (the multi-site demo); see README.md.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# iproute2: `tc` for the per-site egress shaping done by docker/shape-egress.sh.
RUN apt-get update \
    && apt-get install -y --no-install-recommends iproute2 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/lowband

# CPU-only torch from PyTorch's CPU index first: the default index resolves torch to the CUDA
# build (several GB). constraints.txt then pins the same version for everything after.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# Dependencies before the code, so that editing the code does not reinstall them.
COPY pyproject.toml README.md LICENSE constraints.txt ./
COPY lowband/ lowband/
COPY transport/ transport/
COPY diloco/ diloco/
COPY edge/ edge/
RUN pip install -c constraints.txt ".[train,flower]" \
    && python -c "import torch; assert not torch.version.cuda, 'CUDA torch slipped in'"

COPY examples/ examples/
COPY docker/ docker/
RUN chmod +x docker/shape-egress.sh

# Every container shapes its own egress from RATE/DELAY (if set), then runs the command.
ENTRYPOINT ["/opt/lowband/docker/shape-egress.sh"]
CMD ["lowband", "--help"]
