#!/usr/bin/env bash
# Proxy benchmark: berth against nginx and configurable-http-proxy.
#
#   bench/proxy.sh                      # one round, 10 s per wrk run
#   ROUNDS=3 bench/proxy.sh             # three rounds; the table shows medians
#   DURATION=5s CONNS=32 BUILD=0 bench/proxy.sh
#   BUILD=0 BERTH=<new> BERTH_B=<old> ROUNDS=5 TARGETS="nginx berth berth_b" bench/proxy.sh
#                                       # A/B of two berth builds, alternating
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
# * berth_b: only with BERTH_B=<another berth binary>: that build, set up
#            exactly like `berth` but with a backend of its own (a second,
#            identical nginx on its own port, as its instance), so two builds
#            are compared in one run, round by round, under the same load.
#
# TARGETS (default: all of them) picks and orders the targets of a round.
#
# Every target gets the same request (`GET /u/bench/` with the same
# Authorization header), a 2 s warm-up, then `wrk -t1 -c$CONNS -d$DURATION
# --latency` and `wrk -t1 -c1 -d$DURATION --latency` (the added latency of a
# lone request). A run with any non-2xx answer or socket error fails the
# script. The table prints req/s, p50, p99 (medians over ROUNDS).
#
# Installs what is missing: nginx and wrk (apt-get), node/npm (apt-get),
# configurable-http-proxy (npm, into target/bench-tools/chp). Builds berth
# with cargo profile PROFILE (release; dist for packages) unless BUILD=0. Every process it starts is stopped on exit.

set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DURATION=${DURATION:-10s}
CONNS=${CONNS:-32}
ROUNDS=${ROUNDS:-1}
WARMUP=${WARMUP:-2s}
BUILD=${BUILD:-1}
PROFILE=${PROFILE:-release}
BERTH=${BERTH:-$REPO/target/$PROFILE/berth}
BERTH_B=${BERTH_B:-}
TARGETS=${TARGETS:-direct nginx berth${BERTH_B:+ berth_b} chp}
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
    local want_chp=
    [[ " $TARGETS " == *" chp "* ]] && want_chp=1
    [[ -z $want_chp ]] || command -v npm >/dev/null || missing+=(nodejs npm)
    command -v curl >/dev/null || missing+=(curl ca-certificates)
    command -v python3 >/dev/null || missing+=(python3)
    if ((${#missing[@]})); then
        log "installing ${missing[*]} (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    NGINX=$(command -v nginx || echo /usr/sbin/nginx)
    CHP=
    if [[ -z $want_chp ]]; then
        :
    elif command -v configurable-http-proxy >/dev/null; then
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
        log "building berth ($PROFILE)"
        (cd "$REPO" && cargo build --profile "$PROFILE" -q -p berth)
    fi
    [[ -x $BERTH ]] || die "no berth binary at $BERTH (build it, or set BERTH=)"
    [[ -z $BERTH_B || -x $BERTH_B ]] || die "no berth binary at BERTH_B=$BERTH_B"
    if [[ -z $BERTH_B && " $TARGETS " == *" berth_b "* ]]; then
        die "TARGETS names berth_b but BERTH_B is not set"
    fi
}

# --------------------------------------------------------------------------
# Processes: every one started here is recorded and stopped on exit.

WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-bench-proxy.XXXXXX")
PIDS=()
BERTH_URL=
BERTH_B_URL=
TOKEN=

cleanup() {
    local status=$?
    set +e
    # berth's instances outlive berth by design: stop bench's through the
    # API first, then berth, then the rest.
    local url
    for url in $BERTH_URL $BERTH_B_URL; do
        curl -s -o /dev/null -m 10 -X DELETE -H "Authorization: Bearer $TOKEN" \
            "$url/api/v1/users/bench/instance"
    done
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
    # Belt and braces: the backend nginxes, should the API stop have failed.
    local pidfile
    for pidfile in "$WORK"/backend*/nginx.pid; do
        [[ -s $pidfile ]] || continue
        pid=$(cat "$pidfile")
        if [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == "$(readlink -f "$NGINX")" ]]; then
            kill -TERM "$pid" 2>/dev/null
        fi
    done
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
# The targets

# Starts berth binary $1 in $WORK/$2 on port $3, with bench's instance (the
# backend nginx, its files in $WORK/$5) pinned to port $4; sets STARTED_URL.
start_berth() {
    local binary=$1 name=$2 port=$3 backend_port=$4 backend_dir=$5
    mkdir -p "$WORK/$name" "$WORK/$backend_dir"
    cat >"$WORK/$name/berth.toml" <<EOF
listen = "127.0.0.1:$port"
data_dir = "$WORK/$name/data"
admin_token = "$TOKEN"

[instance]
command = ["$WORK/backend.sh", "{port}", "$backend_dir"]
ready_http_path = "/"
ready_timeout_s = 30
port_range = [$backend_port, $backend_port]
stop_grace_s = 2

[reap]
idle_ttl_s = 0

# The proxy's cost is measured, not isolation's (bench/spawn.py isolation
# measures that): the backend nginx runs as the benchmark's own user.
[isolation]
mode = "none"
EOF
    # It holds the admin token: berth refuses a config others can read.
    chmod 600 "$WORK/$name/berth.toml"
    TOKIO_WORKER_THREADS=1 "$binary" serve --config "$WORK/$name/berth.toml" \
        >"$WORK/$name/berth.log" 2>&1 </dev/null &
    PIDS+=($!)
    STARTED_PID=$!
    STARTED_URL=http://127.0.0.1:$port
    wait_200 "$STARTED_URL/healthz" "$name"
    curl -sf -m 60 -o /dev/null -X POST -H "Authorization: Bearer $TOKEN" \
        "$STARTED_URL/api/v1/users/bench/instance" ||
        die "$name could not start bench's instance: $(tail -5 "$WORK/$name/berth.log")"
    wait_200 "http://127.0.0.1:$backend_port/" "backend nginx ($name's instance)"
}

start_all() {
    read -r BACKEND_PORT NGINX_PORT BERTH_PORT CHP_PORT CHP_API_PORT BACKEND_B_PORT BERTH_B_PORT \
        <<<"$(free_ports 7)"
    TOKEN="bench-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    mkdir -p "$WORK/proxy"

    # The backend, as berth's instance program: nginx on {port} ($1), its
    # files in the directory $2 names.
    cat >"$WORK/backend.sh" <<EOF
#!/bin/sh
set -e
conf="$WORK/\$2/nginx.conf"
cat >"\$conf" <<CONF
worker_processes 1;
daemon off;
pid $WORK/\$2/nginx.pid;
error_log $WORK/\$2/error.log warn;
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
exec "$NGINX" -p "$WORK/\$2" -c "\$conf"
EOF
    chmod +x "$WORK/backend.sh"

    # berth, whose instance for `bench` is that backend; and berth_b, with
    # a backend of its own.
    start_berth "$BERTH" berth "$BERTH_PORT" "$BACKEND_PORT" backend
    BERTH_URL=$STARTED_URL
    PID_berth=$STARTED_PID
    if [[ -n $BERTH_B ]]; then
        start_berth "$BERTH_B" berth-b "$BERTH_B_PORT" "$BACKEND_B_PORT" backend-b
        BERTH_B_URL=$STARTED_URL
        PID_berth_b=$STARTED_PID
    fi

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
    if [[ -n $CHP ]]; then
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
    fi

    URL_direct=http://127.0.0.1:$BACKEND_PORT/u/bench/
    URL_nginx=http://127.0.0.1:$NGINX_PORT/u/bench/
    URL_berth=$BERTH_URL/u/bench/
    URL_berth_b=$BERTH_B_URL/u/bench/
    URL_chp=http://127.0.0.1:$CHP_PORT/u/bench/
    local t url
    for t in $TARGETS; do
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

# CPU time (user + system) process $1 has used, in clock ticks.
cpu_ticks() { awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$1/stat"; }

# Runs wrk; prints "req/s p50_us p99_us cpu_us_per_request", the last "-"
# unless $4 names the proxy's pid (berth's CPU per request is steadier
# than its req/s on a shared machine: it does not depend on who else runs).
measure() {
    local url=$1 conns=$2 duration=$3 pid=${4:-} out before=
    [[ -z $pid ]] || before=$(cpu_ticks "$pid")
    out=$(wrk -t1 -c"$conns" -d"$duration" --latency \
        -H "Authorization: Bearer $TOKEN" "$url")
    local cpu=-
    if [[ -n $pid ]]; then
        local ticks requests
        ticks=$(($(cpu_ticks "$pid") - before))
        requests=$(awk '/requests in/ { print $1 }' <<<"$out")
        cpu=$(awk -v t="$ticks" -v r="$requests" -v hz="$(getconf CLK_TCK)" \
            'BEGIN { printf "%.1f", t * 1e6 / hz / r }')
    fi
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
    echo "$rps $(to_us "$p50") $(to_us "$p99") $cpu"
}

median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

# Column $2 (1-based) of the results of target $1 at $3 connections, median.
col() { awk -v t="$1" -v c="$3" -v k="$2" '$1 == t && $2 == c { print $(k + 2) }' "$WORK/results" | median; }

us() { awk -v u="$1" 'BEGIN { if (u >= 1000) printf "%.2f ms", u / 1000; else printf "%d µs", u }'; }

main() {
    install_tools
    start_all
    log "machine: $(nproc) cores, $(uname -sr); load: $(uptime | sed 's/.*load average: //')"
    log "versions: $("$NGINX" -v 2>&1 | sed 's/.*: //'), $(wrk -v 2>&1 | head -1 | awk '{ print $1, $2 }')${CHP:+, configurable-http-proxy $("$CHP" --version), node $(node --version)}"
    : >"$WORK/results"
    local round t url pid
    for round in $(seq "$ROUNDS"); do
        for t in $TARGETS; do
            url=URL_$t
            pid=PID_$t
            measure "${!url}" "$CONNS" "$WARMUP" >/dev/null
            echo "$t $CONNS $(measure "${!url}" "$CONNS" "$DURATION" "${!pid:-}")" >>"$WORK/results"
            echo "$t 1 $(measure "${!url}" 1 "$DURATION")" >>"$WORK/results"
            log "round $round/$ROUNDS: $t: $(grep "^$t " "$WORK/results" | tail -2 | tr '\n' ' ')"
        done
    done
    log "load after: $(uptime | sed 's/.*load average: //')"

    local direct1=
    [[ " $TARGETS " == *" direct "* ]] && direct1=$(col direct 2 1)
    echo
    echo "wrk -t1 -c$CONNS -d$DURATION; c=1 columns: wrk -t1 -c1 -d$DURATION; medians of $ROUNDS round(s)"
    echo
    echo "| target | req/s (c=$CONNS) | p50 | p99 | p50 at c=1 | p99 at c=1 | added p50 at c=1 | CPU µs/req (c=$CONNS) |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|"
    for t in $TARGETS; do
        local added="—" cpu="—"
        [[ $t == direct || -z $direct1 ]] || added="+$(us $(($(col "$t" 2 1) - direct1)))"
        [[ $t != berth* ]] || cpu=$(col "$t" 4 "$CONNS")
        printf '| %s | %s | %s | %s | %s | %s | %s | %s |\n' "$t" "$(col "$t" 1 "$CONNS")" \
            "$(us "$(col "$t" 2 "$CONNS")")" "$(us "$(col "$t" 3 "$CONNS")")" \
            "$(us "$(col "$t" 2 1)")" "$(us "$(col "$t" 3 1)")" "$added" "$cpu"
    done
    echo
    local has_nginx= has_chp= t b
    [[ " $TARGETS " == *" nginx "* ]] && has_nginx=1
    [[ " $TARGETS " == *" chp "* ]] && has_chp=1
    for t in berth berth_b; do
        [[ " $TARGETS " == *" $t "* ]] || continue
        b=$(col "$t" 1 "$CONNS")
        if [[ -n $has_nginx ]]; then
            awk -v t="$t" -v b="$b" -v n="$(col nginx 1 "$CONNS")" -v bp="$(col "$t" 3 "$CONNS")" \
                -v np="$(col nginx 3 "$CONNS")" 'BEGIN {
                printf "%s / nginx req/s: %.2f× (target ≥ 1.0×); %s p99 %s nginx p99 (target: no worse)\n",
                    t, b / n, t, (bp <= np ? "≤" : ">")
            }'
        fi
        if [[ -n $has_chp ]]; then
            awk -v t="$t" -v b="$b" -v c="$(col chp 1 "$CONNS")" 'BEGIN {
                printf "%s / configurable-http-proxy req/s: %.1f× (target ≥ 8×)\n", t, b / c
            }'
        fi
    done
    # Round by round, so an A/B reads as pairs measured moments apart.
    if [[ " $TARGETS " == *" berth "* && " $TARGETS " == *" berth_b "* ]]; then
        echo
        echo "per round at c=$CONNS, req/s (CPU µs/req): berth, berth_b${has_nginx:+, nginx}"
        paste -d' ' <(awk -v c="$CONNS" '$1 == "berth" && $2 == c { print $3, $6 }' "$WORK/results") \
            <(awk -v c="$CONNS" '$1 == "berth_b" && $2 == c { print $3, $6 }' "$WORK/results") \
            <(awk -v c="$CONNS" '$1 == "nginx" && $2 == c { print $3 }' "$WORK/results") |
            awk '{ printf "  round %d: %s (%s), %s (%s)%s\n", NR, $1, $2, $3, $4, ($5 == "" ? "" : ", " $5) }'
    fi
}

main "$@"
