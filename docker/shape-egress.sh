#!/bin/sh
# Shape this container's egress, then run the command (the image's ENTRYPOINT).
#
#   RATE     token-bucket rate for everything leaving IFACE, e.g. 50mbit (unset: no rate limit)
#   DELAY    one-way delay added with netem, e.g. 40ms — only where the host kernel has netem;
#            otherwise a warning and the rate limit alone
#   IFACE    interface to shape (default eth0); BURST / LATENCY tune tbf (default 64kb / 50ms)
#   TC       the tc binary (default tc)
#
# With netem:    root netem (delay) -> child tbf (rate)      [the usual netem + tbf recipe]
# Without netem: root tbf (rate)
# Needs CAP_NET_ADMIN (compose: cap_add: [NET_ADMIN]).
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

exec "$@"
