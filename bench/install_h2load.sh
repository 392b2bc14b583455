#!/bin/sh
# h2load for the benchmark's h2load rows (`make bench`, `make bench-peers`): Debian's
# nghttp2-client, installed with apt where h2load is missing and this runs as root. Never
# fails the benchmark: without h2load its rows are skipped, and the output says so.
command -v h2load >/dev/null 2>&1 && exit 0
install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        nghttp2-client >/dev/null 2>&1
}
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[bench] installing h2load: apt-get install nghttp2-client" >&2
    if install || { apt-get update -qq >/dev/null 2>&1 && install; }; then
        exit 0
    fi
fi
echo "[bench] h2load not found: its rows will be skipped; to measure them, install it as" \
    "root with: apt-get install nghttp2-client (Debian, Ubuntu)" >&2
exit 0
