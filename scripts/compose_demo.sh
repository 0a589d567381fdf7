#!/usr/bin/env bash
# The docker-compose multi-site demo, end to end, checked, and torn down.
#
#   sudo scripts/compose_demo.sh [--steps N] [--rate 50mbit] [--delay 40ms] [--threads N]
#                                [--flower] [--rounds R] [--out DIR] [--project NAME]
#                                [--rmi] [--timeout S]
#
# 1. The engine: uses a running Docker engine as is. Without one (and as root) it installs the
#    Debian packages docker.io + docker-compose when missing and starts its own dockerd, which it
#    stops again at the end.
# 2. The image: `docker build` of the repository's Dockerfile. Where python:3.11-slim cannot be
#    pulled, the base is a Debian bookworm made with debootstrap (kept as a tarball in the cache);
#    the CPU torch wheel is fetched once into the cache and handed in as the WHEELS directory; the
#    host's CA bundle is a build secret (pip behind a TLS-inspecting proxy). Only build arguments
#    differ from what a user runs.
# 3. The demo: `compose up -d report` (coordinators, three shaped sites, then the report, each
#    started on its dependencies' healthcheck/completion), waits for the report and checks it:
#    both runs finished on all three sites with identical final parameters, finite eval losses,
#    steps/s, and DiLoCo sending fewer bytes than DDP. --flower runs the Flower profile as well.
# 4. Teardown, also on failure or Ctrl-C: `compose down` (containers, network), the images it
#    built with --rmi, the dockerd it started. Results stay in --out.
#
# Environment: LOWBAND_COMPOSE_CACHE (default ~/.cache/lowband/compose), BASE (skip the base
# image logic), CA_BUNDLE (default /etc/ssl/certs/ca-certificates.crt), COMPOSE (the compose
# command; default `docker compose` when it exists, else docker-compose).
# Prints `compose_demo: {...}` (build/run seconds and the report) on stdout before the teardown.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${LOWBAND_COMPOSE_CACHE:-$HOME/.cache/lowband/compose}"
STEPS=1000 RATE=50mbit DELAY=40ms THREADS=1 FLOWER=0 ROUNDS=20 RMI=0 TIMEOUT=3600
OUT="$REPO/runs" PROJECT=lowband

die() { echo "compose_demo: $*" >&2; exit 1; }
say() { echo "[compose_demo $(date +%T)] $*" >&2; }
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

while [ $# -gt 0 ]; do
    case "$1" in
        --steps) STEPS="$2"; shift 2 ;;
        --rate) RATE="$2"; shift 2 ;;
        --delay) DELAY="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --flower) FLOWER=1; shift ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --project) PROJECT="$2"; shift 2 ;;
        --rmi) RMI=1; shift ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
case "$STEPS$ROUNDS$THREADS$TIMEOUT" in *[!0-9]*|'') die "--steps/--rounds/--threads/--timeout take positive integers" ;; esac
[ "$STEPS" -gt 0 ] && [ "$ROUNDS" -gt 0 ] && [ "$THREADS" -gt 0 ] || die "--steps, --rounds and --threads must be > 0"
mkdir -p "$OUT" "$CACHE"
OUT="$(cd "$OUT" && pwd)"

# ---- teardown (registered before anything is started) ---------------------------------------
DOCKERD_PID="" BUILT_IMAGES=() WHEEL_COPY="" COMPOSE_UP=0 FORWARD_POLICY=""
teardown() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$COMPOSE_UP" = 1 ]; then
        say "compose down"
        "${COMPOSE[@]}" --profile flower down --remove-orphans -t 5 >&2 || rc=1
    fi
    [ -n "$WHEEL_COPY" ] && find "$WHEEL_COPY" -name '*.whl' -delete
    if [ "$RMI" = 1 ] && [ ${#BUILT_IMAGES[@]} -gt 0 ]; then
        say "removing images ${BUILT_IMAGES[*]}"
        "$DOCKER" rmi "${BUILT_IMAGES[@]}" >&2 || rc=1
        "$DOCKER" builder prune -f >/dev/null 2>&1 || true
    fi
    if [ -n "$DOCKERD_PID" ]; then
        say "stopping the dockerd this script started (pid $DOCKERD_PID)"
        kill -TERM "$DOCKERD_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$DOCKERD_PID" 2>/dev/null; then
            kill -KILL "$DOCKERD_PID" 2>/dev/null || true; rc=1
        fi
    fi
    # dockerd sets the host's FORWARD policy to DROP and leaves it so when it stops, which cuts
    # off every bridge on the machine that is not Docker's (network-namespace testbeds): put back
    # what was there before it started.
    if [ -n "$FORWARD_POLICY" ]; then
        iptables -P FORWARD "$FORWARD_POLICY" || rc=1
    fi
    exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

# ---- 1. the engine ---------------------------------------------------------------------------
DOCKER=docker
# Debian's client matches Debian's engine and has BuildKit built in (a newer CLI may want buildx)
[ -x /usr/bin/docker ] && DOCKER=/usr/bin/docker
if ! "$DOCKER" info >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "no Docker engine answers and installing/starting one needs root"
    if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null; then
        say "installing docker.io docker-compose (Debian packages)"
        DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose >&2
    fi
    DOCKER=/usr/bin/docker
    if [ ! -S /var/run/docker.sock ] || ! "$DOCKER" info >/dev/null 2>&1; then
        FORWARD_POLICY="$(iptables -S FORWARD 2>/dev/null | awk '$1 == "-P" { print $3 }')" || true
        say "starting dockerd (log: $CACHE/dockerd.log)"
        # niced: image builds and the sites run under it, on a machine shared with others
        setsid nice -n 10 dockerd >"$CACHE/dockerd.log" 2>&1 &
        DOCKERD_PID=$!
        for _ in $(seq 120); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 0.5; done
        "$DOCKER" info >/dev/null 2>&1 || die "dockerd did not answer in 60 s: $(tail -5 "$CACHE/dockerd.log")"
    fi
fi
if [ -z "${COMPOSE:-}" ]; then
    if "$DOCKER" compose version >/dev/null 2>&1; then COMPOSE="$DOCKER compose"
    elif command -v docker-compose >/dev/null; then COMPOSE=docker-compose
    else die "neither \`docker compose\` nor docker-compose is installed"; fi
fi
read -r -a COMPOSE <<<"$COMPOSE"
COMPOSE+=(-p "$PROJECT" -f "$REPO/docker-compose.yml" --project-directory "$REPO")
export DOCKER_HOST="${DOCKER_HOST:-unix:///var/run/docker.sock}"
say "engine $("$DOCKER" version -f '{{.Server.Version}}'), compose: $("${COMPOSE[@]}" version --short 2>/dev/null || echo ?)"

# ---- 2. the image ----------------------------------------------------------------------------
t_build=$(date +%s.%N)
BUILD_ARGS=()
if [ -n "${BASE:-}" ]; then
    BUILD_ARGS+=(--build-arg "BASE=$BASE")
elif "$DOCKER" image inspect python:3.11-slim >/dev/null 2>&1 \
        || { [ ! -s "$CACHE/base-bookworm.tar" ] && timeout 60 "$DOCKER" pull -q python:3.11-slim >&2 2>/dev/null; }; then
    say "base image python:3.11-slim"
else
    if ! "$DOCKER" image inspect lowband-base:bookworm >/dev/null 2>&1; then
        if [ ! -s "$CACHE/base-bookworm.tar" ]; then
            command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2
            say "no registry: building a bookworm base with debootstrap (cached in $CACHE)"
            rootfs="$(mktemp -d /tmp/lowband-rootfs.XXXXXX)"
            nice -n 10 debootstrap --variant=minbase \
                --include=python3,python3-venv,python3-pip,iproute2,ca-certificates \
                bookworm "$rootfs" http://deb.debian.org/debian >"$CACHE/debootstrap.log" 2>&1 \
                || { rm -rf "$rootfs"; die "debootstrap failed: $(tail -5 "$CACHE/debootstrap.log")"; }
            rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
            tar -C "$rootfs" -cf "$CACHE/base-bookworm.tar.tmp" . && mv "$CACHE/base-bookworm.tar.tmp" "$CACHE/base-bookworm.tar"
            rm -rf "$rootfs"
        fi
        say "importing the cached base image"
        "$DOCKER" import "$CACHE/base-bookworm.tar" lowband-base:bookworm >/dev/null
        BUILT_IMAGES+=(lowband-base:bookworm)
    fi
    BUILD_ARGS+=(--build-arg BASE=lowband-base:bookworm)
    # No PyTorch index either: the CPU wheel (and what it needs) from this host's pip, once.
    if ! ls "$CACHE"/wheels/torch-2.13.0* >/dev/null 2>&1; then
        say "fetching the CPU torch wheel into $CACHE/wheels"
        python3 -m pip download -q -c "$REPO/constraints.txt" torch==2.13.0 -d "$CACHE/wheels" >&2
    fi
    WHEEL_COPY="$REPO/docker/wheels"
    cp -l "$CACHE"/wheels/*.whl "$WHEEL_COPY"/ 2>/dev/null || cp "$CACHE"/wheels/*.whl "$WHEEL_COPY"/
fi
CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
[ -s "$CA_BUNDLE" ] && BUILD_ARGS+=(--secret "id=ca,src=$CA_BUNDLE")
say "building lowband:latest"
DOCKER_BUILDKIT=1 nice -n 10 "$DOCKER" build "${BUILD_ARGS[@]}" -t lowband:latest "$REPO" >&2
BUILT_IMAGES=(lowband:latest "${BUILT_IMAGES[@]}")
[ -n "$WHEEL_COPY" ] && find "$WHEEL_COPY" -name '*.whl' -delete
build_s=$(since "$t_build")
say "image built in ${build_s} s"

# ---- 3. the demo -----------------------------------------------------------------------------
export RUNS="$OUT" STEPS RATE DELAY THREADS ROUNDS
rm -rf "$OUT/diloco" "$OUT/ddp" "$OUT/flower" "$OUT/report.json" "$OUT/eval_vs_bytes.png"

# Waits for SERVICE's container to exit; prints its exit code.
wait_exit() {
    local id
    id="$("${COMPOSE[@]}" ps -q "$1")"
    [ -n "$id" ] || { echo 255; return; }
    timeout "$TIMEOUT" "$DOCKER" wait "$id" || echo 124
}
# The last lines of every service's log, to see why a run failed.
logs() { "${COMPOSE[@]}" --profile flower logs --no-color --tail 40 >&2 || true; }

t_run=$(date +%s.%N)
say "compose up: coordinators, sites (STEPS=$STEPS RATE=$RATE DELAY=$DELAY), report"
COMPOSE_UP=1
"${COMPOSE[@]}" up -d --no-build report >&2 || { logs; die "compose up failed (logs above)"; }
code="$(wait_exit report)"
run_s=$(since "$t_run")
"${COMPOSE[@]}" logs --no-color report >&2
[ "$code" = 0 ] || { logs; die "the report service exited with $code"; }
say "demo ran in ${run_s} s"

python3 - "$OUT/report.json" "$STEPS" <<'EOF' || die "the report does not hold up (above)"
import json, math, sys
r = json.load(open(sys.argv[1]))
steps = int(sys.argv[2])
bad = []
for name, run in r["runs"].items():
    if run["workers"] != 3: bad.append(f"{name}: {run['workers']} of 3 sites finished")
    if run["steps"] != steps: bad.append(f"{name}: {run['steps']} steps, wanted {steps}")
    if not run["consistent"]: bad.append(f"{name}: the sites ended with different parameters")
    if run["final_eval"] is None or not math.isfinite(run["final_eval"]):
        bad.append(f"{name}: no finite eval loss")
    if not run["steps_per_s"]: bad.append(f"{name}: no steps/s")
if not (r["bytes_ratio"] and r["bytes_ratio"] > 1): bad.append(f"bytes ratio {r['bytes_ratio']}")
print("\n".join(bad), file=sys.stderr)
sys.exit(1 if bad else 0)
EOF

flower_s=null
if [ "$FLOWER" = 1 ]; then
    t_flower=$(date +%s.%N)
    say "compose --profile flower up: SuperLink, 3 SuperNodes, flower-run (ROUNDS=$ROUNDS)"
    "${COMPOSE[@]}" --profile flower up -d --no-build flower-run >&2 \
        || { logs; die "compose --profile flower up failed (logs above)"; }
    code="$(wait_exit flower-run)"
    flower_s=$(since "$t_flower")
    "${COMPOSE[@]}" --profile flower logs --no-color --tail 30 flower-run >&2
    [ "$code" = 0 ] || { logs; die "flower-run exited with $code"; }
    ls "$OUT/flower" >/dev/null 2>&1 || die "the Flower run wrote nothing to $OUT/flower"
    say "Flower run in ${flower_s} s"
fi

echo "compose_demo: {\"build_s\": $build_s, \"run_s\": $run_s, \"flower_s\": $flower_s, \"report\": $(cat "$OUT/report.json")}"
