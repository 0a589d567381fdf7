#!/bin/sh
# Shape this container's egress, then run the command as an unprivileged user (the image's
# ENTRYPOINT). Only `tc` needs root (CAP_NET_ADMIN); the command never runs as root.
#
#   RATE     token-bucket rate for everything leaving IFACE, e.g. 50mbit (unset: no rate limit)
#   DELAY    one-way delay added with netem, e.g. 40ms — only where the host kernel has netem;
#            otherwise a warning and the rate limit alone
#   IFACE    interface to shape (default eth0); BURST / LATENCY tune tbf (default 64kb / 50ms)
#   TC       the tc binary (default tc)
#
# With netem:    root netem (delay) -> child tbf (rate)      [the usual netem + tbf recipe]
# Without netem: root tbf (rate)
#   LOWBAND_USER  run the command as this user (the image sets lowband, created in the
#            Dockerfile); unset: run it as whoever started the script (a host, the tests)
#   LOWBAND_DATA  the directory results are written to (the image sets /runs). A bind mount
#            owned by a host user: the command runs as that uid:gid, so the files are the host
#            user's; one owned by root (Docker creates a missing mount point so) is handed to
#            LOWBAND_USER first
# Needs CAP_NET_ADMIN (compose: cap_add: [NET_ADMIN]). The privileges go before the command
# starts: setpriv changes uid and gid (which clears every capability) and sets no_new_privs.
set -eu

TC="${TC:-tc}"
IFACE="${IFACE:-eth0}"
BURST="${BURST:-64kb}"
LATENCY="${LATENCY:-50ms}"

netem=0
if [ -n "${DELAY:-}" ]; then
    if "$TC" qdisc replace dev "$IFACE" root handle 1: netem delay "$DELAY" 2>/dev/null; then
        netem=1
        echo "shape-egress: $IFACE delay $DELAY (netem)" >&2
    else
        echo "shape-egress: netem is not available on this kernel; DELAY=$DELAY not applied" >&2
    fi
fi
if [ -n "${RATE:-}" ]; then
    if [ "$netem" = 1 ]; then
        "$TC" qdisc replace dev "$IFACE" parent 1:1 handle 10: tbf rate "$RATE" burst "$BURST" latency "$LATENCY"
    else
        "$TC" qdisc replace dev "$IFACE" root tbf rate "$RATE" burst "$BURST" latency "$LATENCY"
    fi
    echo "shape-egress: $IFACE rate $RATE (tbf)" >&2
fi

if [ "$(id -u)" = 0 ] && [ -n "${LOWBAND_USER:-}" ]; then
    user="$LOWBAND_USER" group="$(id -g "$LOWBAND_USER")" groups=--init-groups
    home="$(getent passwd "$user" | cut -d: -f6)"
    data="${LOWBAND_DATA:-}"
    if [ -n "$data" ] && [ -d "$data" ]; then
        owner="$(stat -c %u "$data")"
        if [ "$owner" = 0 ]; then
            chown -R "$user:$group" "$data"
        elif [ "$owner" != "$(id -u "$user")" ]; then
            user="$owner" group="$(stat -c %g "$data")" groups=--clear-groups
            home="/tmp/home-$user"
            mkdir -p "$home" && chown "$user:$group" "$home"
        fi
    fi
    if ! command -v setpriv >/dev/null; then
        echo "shape-egress: setpriv (util-linux) is missing; refusing to run the command as root" >&2
        exit 1
    fi
    echo "shape-egress: running as $user:$group" >&2
    HOME="$home" exec setpriv --reuid="$user" --regid="$group" "$groups" --no-new-privs -- "$@"
fi
exec "$@"
