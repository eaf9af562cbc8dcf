#!/usr/bin/env bash
# User-space instructions per proxied request, counted by callgrind: a
# measure of berth's proxy cost that, unlike req/s or CPU time, does not
# move with the machine's load, so two builds compare exactly.
#
#   bench/proxy-ir.sh BERTH_BINARY...          # e.g. target/release/berth /tmp/old/berth
#   RUNS=2 REQUESTS_FOR=5s bench/proxy-ir.sh a/berth b/berth
#   KEEP=1 bench/proxy-ir.sh a/berth b/berth   # keep the callgrind dumps
#                                              # (for callgrind_annotate)
#
# For each binary (RUNS times, alternating): a backend nginx (one worker,
# `return 200`) as user `bench`'s instance, `berth serve` under
# `valgrind --tool=callgrind` with TOKIO_WORKER_THREADS=1, a 3 s warm-up of
# `wrk -t1 -c8` against `/u/bench/` with the admin token (route → auth →
# wake check → forward), then the counters are zeroed, `wrk -t1 -c8` runs
# for REQUESTS_FOR (5s), and the instructions callgrind counted in berth
# over that run are divided by the requests wrk completed. Timers and
# background tasks are counted too; at these rates they are noise.
# callgrind runs sha256 without SHA-NI, so the admin-token check weighs
# more than natively (about 3.5k instructions).
#
# Needs valgrind, nginx and wrk (installed with apt-get if missing).

set -euo pipefail

RUNS=${RUNS:-1}
REQUESTS_FOR=${REQUESTS_FOR:-5s}
KEEP=${KEEP:-0}
(($# > 0)) || {
    echo "usage: $0 BERTH_BINARY..." >&2
    exit 2
}

log() { printf '%s\n' "$*" >&2; }
die() {
    log "proxy-ir.sh: $*"
    exit 1
}

missing=()
command -v valgrind >/dev/null || missing+=(valgrind)
command -v nginx >/dev/null || [[ -x /usr/sbin/nginx ]] || missing+=(nginx)
command -v wrk >/dev/null || missing+=(wrk)
command -v curl >/dev/null || missing+=(curl ca-certificates)
if ((${#missing[@]})); then
    log "installing ${missing[*]} (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
for binary in "$@"; do
    [[ -x $binary ]] || die "no berth binary at $binary"
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-bench-ir.XXXXXX")
BERTH_PID=
BERTH_URL=
TOKEN="bench-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"

stop_berth() {
    if [[ -n $BERTH_URL ]]; then
        curl -s -o /dev/null -m 30 -X DELETE -H "Authorization: Bearer $TOKEN" \
            "$BERTH_URL/api/v1/users/bench/instance" || true
    fi
    if [[ -n $BERTH_PID ]]; then
        kill -TERM "$BERTH_PID" 2>/dev/null || true
        for _ in $(seq 100); do
            kill -0 "$BERTH_PID" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$BERTH_PID" 2>/dev/null || true
        wait "$BERTH_PID" 2>/dev/null || true
    fi
    # Belt and braces: the backend nginx, should the API stop have failed.
    local pidfile pid
    for pidfile in "$WORK"/run-*/backend/nginx.pid; do
        [[ -s $pidfile ]] || continue
        pid=$(cat "$pidfile")
        if [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == "$(readlink -f "$NGINX")" ]]; then
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    BERTH_PID=
    BERTH_URL=
}

cleanup() {
    local status=$?
    set +e
    stop_berth
    if [[ $KEEP == 1 ]]; then
        log "kept $WORK (run-N/cg.out.*: the measured dumps)"
    else
        rm -rf "$WORK"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_ports() {
    python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

wait_200() {
    local url=$1 what=$2
    shift 2
    for _ in $(seq 1200); do
        if [[ $(curl -s -o /dev/null -w '%{http_code}' -m 5 "$@" "$url") == 200 ]]; then
            return 0
        fi
        sleep 0.1
    done
    die "$what did not answer 200 at $url"
}

# Instructions per request of binary $1 in run directory $2.
measure() {
    local binary=$1 dir=$2 backend_port berth_port
    read -r backend_port berth_port <<<"$(free_ports 2)"
    mkdir -p "$dir/backend"
    cat >"$dir/backend.sh" <<EOF
#!/bin/sh
set -e
cat >"$dir/backend/nginx.conf" <<CONF
worker_processes 1;
daemon off;
pid $dir/backend/nginx.pid;
error_log $dir/backend/error.log warn;
events { worker_connections 1024; }
http {
    access_log off;
    keepalive_requests 1000000;
    server {
        listen 127.0.0.1:\$1;
        location / { return 200 "ok\\\\n"; }
    }
}
CONF
exec "$NGINX" -p "$dir/backend" -c "$dir/backend/nginx.conf"
EOF
    chmod +x "$dir/backend.sh"
    cat >"$dir/berth.toml" <<EOF
listen = "127.0.0.1:$berth_port"
data_dir = "$dir/data"
admin_token = "$TOKEN"

[instance]
command = ["$dir/backend.sh", "{port}"]
ready_http_path = "/"
ready_timeout_s = 120
port_range = [$backend_port, $backend_port]
stop_grace_s = 2

[reap]
idle_ttl_s = 0
EOF
    TOKIO_WORKER_THREADS=1 valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" \
        "$binary" serve --config "$dir/berth.toml" >"$dir/berth.log" 2>&1 </dev/null &
    BERTH_PID=$!
    BERTH_URL=http://127.0.0.1:$berth_port
    wait_200 "$BERTH_URL/healthz" "berth under callgrind"
    curl -sf -m 120 -o /dev/null -X POST -H "Authorization: Bearer $TOKEN" \
        "$BERTH_URL/api/v1/users/bench/instance" ||
        die "berth could not start bench's instance: $(tail -5 "$dir/berth.log")"
    local url=$BERTH_URL/u/bench/
    wait_200 "$url" "bench through berth" -H "Authorization: Bearer $TOKEN"
    wrk -t1 -c8 -d3s -H "Authorization: Bearer $TOKEN" "$url" >/dev/null
    callgrind_control -z "$BERTH_PID" >/dev/null 2>&1
    local out
    out=$(wrk -t1 -c8 -d"$REQUESTS_FOR" -H "Authorization: Bearer $TOKEN" "$url")
    grep -qE 'Non-2xx|Socket errors' <<<"$out" && die "errors while measuring:
$out"
    callgrind_control -d "$BERTH_PID" >/dev/null 2>&1
    local requests dump ir
    requests=$(awk '/requests in/ { print $1 }' <<<"$out")
    dump=$(ls -t "$dir"/cg.out.* | head -1)
    ir=$(awk '/^(summary|totals):/ { print $2; exit }' "$dump")
    [[ -n $requests && -n $ir ]] || die "cannot read the counts ($dump)"
    stop_berth
    awk -v ir="$ir" -v n="$requests" 'BEGIN { printf "%.0f %d\n", ir / n, n }'
}

log "machine: $(nproc) cores, $(uname -sr); load: $(uptime | sed 's/.*load average: //')"
run=0
declare -A results
for round in $(seq "$RUNS"); do
    for binary in "$@"; do
        run=$((run + 1))
        read -r per n <<<"$(measure "$binary" "$WORK/run-$run")"
        log "round $round: $binary: $per instructions/request ($n requests)"
        results[$binary]+="$per "
    done
done
echo
echo "| berth binary | instructions per request (each run) |"
echo "|---|---|"
for binary in "$@"; do
    echo "| $binary | ${results[$binary]% } |"
done
