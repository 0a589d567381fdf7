#!/bin/bash
# .ci/run on a machine that never ran it: a Debian bookworm root made by debootstrap (nothing of
# lowband installed or built there), entered with chroot. Only the host's pip configuration and
# local wheel indexes (/opt/wheels, /opt/pypi*) are shared, read-only; HOME is empty.
#
#   sudo bash scripts/fresh_ci.sh [REV] [ROOT]     # REV default HEAD, ROOT default a new temp dir
#
# Needs root, debootstrap and a Debian mirror. The root gets what a developer's Debian machine
# has before lowband: python3 with venv, pip and its C headers, g++, git, iproute2, iptables,
# procps. Limits of a chroot (not of a fresh VM): the compose test's dockerd runs inside the
# chroot, where runc cannot `docker exec` into a container ("chdir to cwd ... no such file or
# directory"), so every compose health check fails and that one test fails here; the same test
# passes where dockerd runs on a real root. Network namespaces work (the root is bind-mounted onto
# itself: `ip netns exec` needs / to be a mount point).
set -u
REV=${1:-HEAD}
R=${2:-$(mktemp -d /tmp/lowband-fresh.XXXXXX)}
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -x "$R/usr/bin/python3" ]; then
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,python3-dev,g++,git,iproute2,iptables,ca-certificates,procps \
    bookworm "$R" http://deb.debian.org/debian || exit 1
fi
mountpoint -q "$R" || mount --bind "$R" "$R"
for d in proc sys dev opt/wheels opt/pypi opt/pypi-more; do mkdir -p "$R/$d"; done
mountpoint -q "$R/proc" || mount -t proc proc "$R/proc"
mountpoint -q "$R/sys" || mount --rbind /sys "$R/sys"
mountpoint -q "$R/dev" || mount --rbind /dev "$R/dev"
for d in opt/wheels opt/pypi opt/pypi-more; do
  [ -d "/$d" ] && { mountpoint -q "$R/$d" || mount --bind -o ro "/$d" "$R/$d"; }
done
[ -d /etc/xdg/pip ] && mkdir -p "$R/etc/xdg" && cp -r /etc/xdg/pip "$R/etc/xdg/"
[ -f /etc/pip.conf ] && cp /etc/pip.conf "$R/etc/pip.conf"
cp /etc/ssl/certs/ca-certificates.crt "$R/etc/ssl/certs/ca-certificates.crt"
cp /etc/resolv.conf "$R/etc/resolv.conf"
rm -rf "$R/ci" && mkdir -p "$R/ci/home"
git clone -q "$REPO" "$R/ci/repo" && git -C "$R/ci/repo" checkout -q "$REV"
git -C "$R/ci/repo" log --oneline -1
chroot "$R" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/ci/home CI=true PIP_NO_CACHE_DIR=1 PIP_DEFAULT_TIMEOUT=180 PIP_DISABLE_PIP_VERSION_CHECK=1 \
  PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_FIND_LINKS=/opt/wheels LANG=C.UTF-8 \
  /bin/bash -c 'cd /ci/repo && time timeout 5400 bash .ci/run'
rc=$?
echo "fresh .ci/run rc=$rc (root: $R)"
# Leave nothing mounted. Processes still inside the root would lose it: end them first.
for p in /proc/[0-9]*; do
  [ "$(readlink "$p/root" 2>/dev/null)" = "$R" ] && kill -9 "${p#/proc/}" 2>/dev/null
done
umount -R "$R/proc" "$R/sys" "$R/dev" 2>/dev/null
umount "$R/opt/wheels" "$R/opt/pypi" "$R/opt/pypi-more" 2>/dev/null
for n in "$R"/run/netns/*; do [ -e "$n" ] && umount "$n" && rm -f "$n"; done
umount "$R/run/netns" 2>/dev/null
umount -l "$R" 2>/dev/null
exit $rc
