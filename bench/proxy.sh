#!/usr/bin/env bash
# Proxy benchmark of issue 3: berth against nginx and configurable-http-proxy.
#
#   bench/proxy.sh                      # one round, 10 s per wrk run
#   ROUNDS=3 bench/proxy.sh             # three rounds; the table shows medians
#   DURATION=5s CONNS=32 BUILD=0 bench/proxy.sh
#
# Everything runs in one run on this machine, on 127.0.0.1 only:
#
# * backend: nginx, one worker, `return 200 "ok\n"`. It is started *by
#   berth*, as the instance of user `bench` (the instance command is a tiny
#   wrapper that execs nginx on berth's `{port}`), so berth forwards to it
#   exactly as to any user's program. The port range is pinned to one free
#   port, and nginx-as-proxy and configurable-http-proxy forward to that same
#   nginx on that same port: one backend for all.
# * direct:  wrk → backend.
# * nginx:   wrk → nginx (one worker; HTTP/1.1 upstream with keepalive,
#            `Connection ""`, the same X-Forwarded-* headers berth sets) →
#            backend.
# * berth:   wrk → `berth serve` (TOKIO_WORKER_THREADS=1) → backend. The
#            request is `/u/bench/` with the admin token as Bearer, so the
#            full route → auth → wake check → forward path runs.
# * chp:     wrk → configurable-http-proxy (node is single-threaded), with the
#            route /u/bench → backend added through its API.
#
# Every target gets the same request (`GET /u/bench/` with the same
# Authorization header), a 2 s warm-up, then `wrk -t1 -c$CONNS -d$DURATION
# --latency` and `wrk -t1 -c1 -d$DURATION --latency` (the added latency of a
# lone request). A run with any non-2xx answer or socket error fails the
# script. The table prints req/s, p50, p99 (medians over ROUNDS).
#
# Installs what is missing: nginx and wrk (apt-get), node/npm (apt-get),
# configurable-http-proxy (npm, into target/bench-tools/chp). Builds berth
# in release unless BUILD=0. Every process it starts is stopped on exit.

set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DURATION=${DURATION:-10s}
CONNS=${CONNS:-32}
ROUNDS=${ROUNDS:-1}
WARMUP=${WARMUP:-2s}
BUILD=${BUILD:-1}
BERTH=${BERTH:-$REPO/target/release/berth}
CHP_DIR=$REPO/target/bench-tools/chp

log() { printf '%s\n' "$*" >&2; }
die() {
    log "proxy.sh: $*"
    exit 1
}

# --------------------------------------------------------------------------
# Tools

install_tools() {
    local missing=()
    command -v nginx >/dev/null || [[ -x /usr/sbin/nginx ]] || missing+=(nginx)
    command -v wrk >/dev/null || missing+=(wrk)
    command -v npm >/dev/null || missing+=(nodejs npm)
    command -v curl >/dev/null || missing+=(curl ca-certificates)
    command -v python3 >/dev/null || missing+=(python3)
    if ((${#missing[@]})); then
        log "installing ${missing[*]} (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    NGINX=$(command -v nginx || echo /usr/sbin/nginx)
    if command -v configurable-http-proxy >/dev/null; then
        CHP=$(command -v configurable-http-proxy)
    else
        CHP=$CHP_DIR/node_modules/.bin/configurable-http-proxy
        if [[ ! -x $CHP ]]; then
            log "installing configurable-http-proxy (npm, into $CHP_DIR)"
            mkdir -p "$CHP_DIR"
            npm install --silent --no-audit --no-fund --prefix "$CHP_DIR" configurable-http-proxy >/dev/null
        fi
    fi
    if [[ $BUILD == 1 ]]; then
        log "building berth (release)"
        (cd "$REPO" && cargo build --release -q -p berth)
    fi
    [[ -x $BERTH ]] || die "no berth binary at $BERTH (build it, or set BERTH=)"
}

# --------------------------------------------------------------------------
# Processes: every one started here is recorded and stopped on exit.

WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-bench-proxy.XXXXXX")
PIDS=()
BERTH_URL=
TOKEN=

cleanup() {
    local status=$?
    set +e
    # berth's instances outlive berth by design: stop bench's through the
    # API first, then berth, then the rest.
    if [[ -n $BERTH_URL ]]; then
        curl -s -o /dev/null -m 10 -X DELETE -H "Authorization: Bearer $TOKEN" \
            "$BERTH_URL/api/v1/users/bench/instance"
    fi
    local pid
    for pid in "${PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null
    done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    # Belt and braces: the backend nginx, should the API stop have failed.
    if [[ -s $WORK/backend/nginx.pid ]]; then
        pid=$(cat "$WORK/backend/nginx.pid")
        if [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == "$(readlink -f "$NGINX")" ]]; then
            kill -TERM "$pid" 2>/dev/null
        fi
    fi
    rm -rf "$WORK"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# N free loopback ports, bound at once so they differ.
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

# Waits until `curl <url>` answers 200 (headers as further args).
wait_200() {
    local url=$1 what=$2
    shift 2
    for _ in $(seq 300); do
        if [[ $(curl -s -o /dev/null -w '%{http_code}' -m 2 "$@" "$url") == 200 ]]; then
            return 0
        fi
        sleep 0.1
    done
    die "$what did not answer 200 at $url"
}

# --------------------------------------------------------------------------
# The four targets

start_all() {
    read -r BACKEND_PORT NGINX_PORT BERTH_PORT CHP_PORT CHP_API_PORT <<<"$(free_ports 5)"
    TOKEN="bench-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    mkdir -p "$WORK/backend" "$WORK/proxy" "$WORK/berth"

    # The backend, as berth's instance program: nginx on {port}.
    cat >"$WORK/backend.sh" <<EOF
#!/bin/sh
set -e
conf="$WORK/backend/nginx.conf"
cat >"\$conf" <<CONF
worker_processes 1;
daemon off;
pid $WORK/backend/nginx.pid;
error_log $WORK/backend/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    keepalive_requests 1000000;
    server {
        listen 127.0.0.1:\$1;
        location / { return 200 "ok\\\\n"; }
    }
}
CONF
exec "$NGINX" -p "$WORK/backend" -c "\$conf"
EOF
    chmod +x "$WORK/backend.sh"

    # berth, whose instance for `bench` is that backend.
    cat >"$WORK/berth/berth.toml" <<EOF
listen = "127.0.0.1:$BERTH_PORT"
data_dir = "$WORK/berth/data"
admin_token = "$TOKEN"

[instance]
command = ["$WORK/backend.sh", "{port}"]
ready_http_path = "/"
ready_timeout_s = 30
port_range = [$BACKEND_PORT, $BACKEND_PORT]
stop_grace_s = 2

[reap]
idle_ttl_s = 0
EOF
    TOKIO_WORKER_THREADS=1 "$BERTH" serve --config "$WORK/berth/berth.toml" \
        >"$WORK/berth/berth.log" 2>&1 </dev/null &
    PIDS+=($!)
    BERTH_URL=http://127.0.0.1:$BERTH_PORT
    wait_200 "$BERTH_URL/healthz" berth
    curl -sf -m 60 -o /dev/null -X POST -H "Authorization: Bearer $TOKEN" \
        "$BERTH_URL/api/v1/users/bench/instance" ||
        die "berth could not start bench's instance: $(tail -5 "$WORK/berth/berth.log")"
    wait_200 "http://127.0.0.1:$BACKEND_PORT/" "backend nginx (bench's instance)"

    # nginx as a reverse proxy, configured as one would for production.
    cat >"$WORK/proxy/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $WORK/proxy/nginx.pid;
error_log $WORK/proxy/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    keepalive_requests 1000000;
    upstream backend {
        server 127.0.0.1:$BACKEND_PORT;
        keepalive 64;
        keepalive_requests 1000000;
    }
    server {
        listen 127.0.0.1:$NGINX_PORT;
        location / {
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host \$http_host;
            proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto \$scheme;
            proxy_set_header X-Forwarded-Host \$http_host;
        }
    }
}
EOF
    "$NGINX" -p "$WORK/proxy" -c "$WORK/proxy/nginx.conf" &
    PIDS+=($!)

    # configurable-http-proxy, with the route JupyterHub would add.
    CONFIGPROXY_AUTH_TOKEN=$TOKEN "$CHP" --ip 127.0.0.1 --port "$CHP_PORT" \
        --api-ip 127.0.0.1 --api-port "$CHP_API_PORT" --log-level warn \
        >"$WORK/chp.log" 2>&1 </dev/null &
    PIDS+=($!)
    for _ in $(seq 300); do
        curl -s -o /dev/null -m 2 "http://127.0.0.1:$CHP_API_PORT/api/routes" \
            -H "Authorization: token $TOKEN" && break
        sleep 0.1
    done
    curl -sf -m 5 -o /dev/null -X POST -H "Authorization: token $TOKEN" \
        -d "{\"target\":\"http://127.0.0.1:$BACKEND_PORT\"}" \
        "http://127.0.0.1:$CHP_API_PORT/api/routes/u/bench" ||
        die "configurable-http-proxy did not take the route: $(tail -5 "$WORK/chp.log")"

    URL_direct=http://127.0.0.1:$BACKEND_PORT/u/bench/
    URL_nginx=http://127.0.0.1:$NGINX_PORT/u/bench/
    URL_berth=$BERTH_URL/u/bench/
    URL_chp=http://127.0.0.1:$CHP_PORT/u/bench/
    local t url
    for t in direct nginx berth chp; do
        url=URL_$t
        wait_200 "${!url}" "$t" -H "Authorization: Bearer $TOKEN"
    done
}

# --------------------------------------------------------------------------
# Measuring

# A wrk latency ("123.45us", "1.20ms", "2.00s") in microseconds.
to_us() {
    awk -v v="$1" 'BEGIN {
        n = v + 0
        if (v ~ /us$/) m = 1; else if (v ~ /ms$/) m = 1000;
        else if (v ~ /m$/) m = 60e6; else if (v ~ /s$/) m = 1e6; else m = 1
        printf "%.0f", n * m
    }'
}

# Runs wrk; prints "req/s p50_us p99_us".
measure() {
    local url=$1 conns=$2 duration=$3 out
    out=$(wrk -t1 -c"$conns" -d"$duration" --latency \
        -H "Authorization: Bearer $TOKEN" "$url")
    if grep -qE 'Non-2xx|Socket errors' <<<"$out"; then
        die "errors while measuring $url:
$out"
    fi
    local rps p50 p99
    rps=$(awk '/^Requests\/sec:/ { printf "%.0f", $2 }' <<<"$out")
    p50=$(awk '$1 == "50%" { print $2 }' <<<"$out")
    p99=$(awk '$1 == "99%" { print $2 }' <<<"$out")
    [[ -n $rps && -n $p50 && -n $p99 ]] || die "cannot read wrk's output:
$out"
    echo "$rps $(to_us "$p50") $(to_us "$p99")"
}

median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

# Column $2 (1-based) of the results of target $1 at $3 connections, median.
col() { awk -v t="$1" -v c="$3" -v k="$2" '$1 == t && $2 == c { print $(k + 2) }' "$WORK/results" | median; }

us() { awk -v u="$1" 'BEGIN { if (u >= 1000) printf "%.2f ms", u / 1000; else printf "%d µs", u }'; }

main() {
    install_tools
    start_all
    log "machine: $(nproc) cores, $(uname -sr); load: $(uptime | sed 's/.*load average: //')"
    log "versions: $("$NGINX" -v 2>&1 | sed 's/.*: //'), configurable-http-proxy $("$CHP" --version), node $(node --version), $(wrk -v 2>&1 | head -1 | awk '{ print $1, $2 }')"
    : >"$WORK/results"
    local round t url
    for round in $(seq "$ROUNDS"); do
        for t in direct nginx berth chp; do
            url=URL_$t
            measure "${!url}" "$CONNS" "$WARMUP" >/dev/null
            echo "$t $CONNS $(measure "${!url}" "$CONNS" "$DURATION")" >>"$WORK/results"
            echo "$t 1 $(measure "${!url}" 1 "$DURATION")" >>"$WORK/results"
            log "round $round/$ROUNDS: $t: $(grep "^$t " "$WORK/results" | tail -2 | tr '\n' ' ')"
        done
    done
    log "load after: $(uptime | sed 's/.*load average: //')"

    local direct1
    direct1=$(col direct 2 1)
    echo
    echo "wrk -t1 -c$CONNS -d$DURATION; c=1 columns: wrk -t1 -c1 -d$DURATION; medians of $ROUNDS round(s)"
    echo
    echo "| target | req/s (c=$CONNS) | p50 | p99 | p50 at c=1 | p99 at c=1 | added p50 at c=1 |"
    echo "|---|---:|---:|---:|---:|---:|---:|"
    for t in direct nginx berth chp; do
        local added="—"
        [[ $t == direct ]] || added="+$(us $(($(col "$t" 2 1) - direct1)))"
        printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$t" "$(col "$t" 1 "$CONNS")" \
            "$(us "$(col "$t" 2 "$CONNS")")" "$(us "$(col "$t" 3 "$CONNS")")" \
            "$(us "$(col "$t" 2 1)")" "$(us "$(col "$t" 3 1)")" "$added"
    done
    local b n c
    b=$(col berth 1 "$CONNS")
    n=$(col nginx 1 "$CONNS")
    c=$(col chp 1 "$CONNS")
    echo
    awk -v b="$b" -v n="$n" -v c="$c" -v bp="$(col berth 3 "$CONNS")" -v np="$(col nginx 3 "$CONNS")" 'BEGIN {
        printf "berth / nginx req/s: %.2f× (target ≥ 1.0×); berth p99 %s nginx p99 (target: no worse)\n",
            b / n, (bp <= np ? "≤" : ">")
        printf "berth / configurable-http-proxy req/s: %.1f× (target ≥ 8×)\n", b / c
    }'
}

main "$@"
