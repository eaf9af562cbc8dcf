#!/usr/bin/env python3
"""Egress proxy benchmark: what a connection through it costs, standard
library only. Run as root (accounts, network namespaces).

    python3 bench/egress.py [--berth target/release/berth] [--n 2000] [--level sandbox]

Two network namespaces, made for the run and removed after it: `host`,
where berth runs, and `outside`, behind a veth pair, holding two HTTP
hosts that answer every connection with a 2-byte body and close:
198.51.100.8 (named `allowed.test` in the host namespace's /etc/hosts) and
10.254.0.7. berth runs with

    egress = "allowlist"
    egress_allow = ["allowed.test", "10.254.0.0/24:80"]

so one user's instance reaches the first by name *through the egress
proxy* (redirected by the guard, the name read from the Host header,
resolved and connected by the proxy) and the second *directly* (an
allowed network). The instance (a Python program, run by berth under its
own account) times `--n` sequential connections to each, alternating:
connect, send a GET, read to the end. Printed: median, p95 and p99 per
path, in microseconds, and the added cost of the proxy.

With `--level sandbox` the instance is sandboxed and has no route out:
each connection goes through its relay (`CONNECT host:80` to the
HTTPS_PROXY berth names, then the GET), which connects as the instance's
account; the guard and the egress proxy then act as above.

With `--level pods` berth runs on the Kubernetes runtime against the
API-server double (`--double`, built with `cargo build --release -p
berth-k8s --features test-double --example apiserver-double`), whose
stand-in kubelet runs the same program as a pod's, in the same namespace.
The named path then goes through berth's egress proxy for pods: `CONNECT`
with the pod's credential from its HTTPS_PROXY, checked against the
user's policy read from the store, resolved and connected by berth. The
direct path is a plain connection (a real cluster's NetworkPolicy would
allow it; the double enforces none).
"""

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spawn  # noqa: E402  (the Berth harness)

HOST_NS, OUTSIDE_NS = "berth-bench-eh", "berth-bench-eo"
NAMED, DIRECT = "198.51.100.8", "10.254.0.7"

SERVER = r"""
import socket, threading, sys
def serve(addr):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 80)); s.listen(512)
    while True:
        c, _ = s.accept()
        try:
            c.recv(4096); c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
        finally:
            c.close()
for a in sys.argv[1:]:
    threading.Thread(target=serve, args=(a,), daemon=True).start()
print("serving", flush=True)
threading.Event().wait()
"""

AGENT = r"""
import json, os, socket, sys, time, urllib.parse
from http.server import BaseHTTPRequestHandler, HTTPServer
def ask(s, host, name, got=b""):
    s.sendall(("GET / HTTP/1.0\r\nHost: %s\r\n\r\n" % name).encode())
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    if not got.startswith(b"HTTP/1.0 200"):
        raise RuntimeError("no answer from %s" % host)
def once(host, name):
    t0 = time.perf_counter()
    with socket.create_connection((host, 80), timeout=5) as s:
        ask(s, host, name)
    return (time.perf_counter() - t0) * 1e6
PROXY = urllib.parse.urlsplit(os.environ.get("HTTPS_PROXY", ""))
AUTH = ""
if PROXY.username:
    import base64
    AUTH = "Proxy-Authorization: Basic %s\r\n" % base64.b64encode(
        ("%s:%s" % (PROXY.username, PROXY.password)).encode()).decode()
def relayed(host, name):
    t0 = time.perf_counter()
    with socket.create_connection((PROXY.hostname, PROXY.port), timeout=5) as s:
        s.sendall(("CONNECT %s:80 HTTP/1.1\r\n%s\r\n" % (host, AUTH)).encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                raise RuntimeError("the relay closed")
            head += chunk
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError("relay: %r" % head[:40])
        ask(s, host, name, head.split(b"\r\n\r\n", 1)[1])
    return (time.perf_counter() - t0) * 1e6
plain = direct = once
if "HTTPS_PROXY" in os.environ:
    once = relayed
    # A sandbox has no route out: both paths go through its relay. A pod
    # reaches an allowed network directly, and only names through berth.
    direct = plain if PROXY.username else relayed
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        n = int(q.get("n", ["0"])[0])
        out = {"proxy": [], "direct": []}
        for _ in range(n):
            out["proxy"].append(once("allowed.test", "allowed.test"))
            out["direct"].append(direct("DIRECT_HOST", "anything"))
        body = json.dumps(out).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""".replace("DIRECT_HOST", DIRECT)


def ip(*args):
    subprocess.run(["ip", *args], check=True)


def setup():
    ip("netns", "add", HOST_NS)
    ip("netns", "add", OUTSIDE_NS)
    ip("-n", HOST_NS, "link", "add", "bbe-h", "type", "veth", "peer", "name", "bbe-o",
       "netns", OUTSIDE_NS)
    for ns, args in [
        (HOST_NS, ["link", "set", "lo", "up"]),
        (OUTSIDE_NS, ["link", "set", "lo", "up"]),
        (HOST_NS, ["addr", "add", "10.231.9.1/24", "dev", "bbe-h"]),
        (OUTSIDE_NS, ["addr", "add", "10.231.9.2/24", "dev", "bbe-o"]),
        (HOST_NS, ["link", "set", "bbe-h", "up"]),
        (OUTSIDE_NS, ["link", "set", "bbe-o", "up"]),
        (HOST_NS, ["route", "add", "default", "via", "10.231.9.2"]),
        (OUTSIDE_NS, ["addr", "add", NAMED + "/32", "dev", "lo"]),
        (OUTSIDE_NS, ["addr", "add", DIRECT + "/32", "dev", "lo"]),
    ]:
        ip("-n", ns, *args)
    etc = f"/etc/netns/{HOST_NS}"
    os.makedirs(etc, exist_ok=True)
    with open(f"{etc}/hosts", "w") as f:
        f.write(f"127.0.0.1 localhost\n{NAMED} allowed.test\n")
    server = subprocess.Popen(
        ["ip", "netns", "exec", OUTSIDE_NS, "/usr/bin/python3", "-c", SERVER, NAMED, DIRECT],
        stdout=subprocess.PIPE)
    server.stdout.readline()
    return server


def teardown(server):
    if server is not None:
        server.kill()
        server.wait()
    for ns in (HOST_NS, OUTSIDE_NS):
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
    subprocess.run(["rm", "-rf", f"/etc/netns/{HOST_NS}"])


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p * len(xs)) - 1))]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inner(args):
    """Inside the host namespace: berth, one instance, the timings."""
    command = f"[\"/usr/bin/python3\", \"-c\", {json.dumps(AGENT)}, \"{{port}}\"]"
    egress = 'egress = "allowlist"\negress_allow = ["allowed.test", "10.254.0.0/24:80"]\n'
    if args.level != "pods":
        instance = f"command = {command}\nready_tcp = true\n"
        with spawn.Berth(args.berth, isolation=args.level, parent="/var/tmp",
                         instance_extra=instance, isolation_extra=egress) as berth:
            return measure(berth, args.n)
    with spawn.api_server_double(args.double) as kubeconfig:
        pods = (f'[kubernetes]\nkubeconfig = "{kubeconfig}"\nimage = "bench.invalid/none:1"\n'
                f'command = {command}\nendpoint = "endpoint_slice"\n'
                f'[kubernetes.network]\negress_proxy = "127.0.0.1:{free_port()}"\n')
        secret = f'cluster_secret = "{os.urandom(24).hex()}"\n'
        with spawn.Berth(args.berth, parent="/var/tmp", instance_extra="ready_tcp = true\n",
                         isolation_extra=egress, top_extra=secret,
                         tables_extra=pods) as berth:
            return measure(berth, args.n)


def measure(berth, n):
    """alice's instance times `n` connections on each path."""
    conn = berth.connection()
    status, body, _ = berth.launch(conn, "alice")
    if status != 201:
        raise RuntimeError(f"launch: {status} {body!r}")
    conn.request("GET", f"/u/alice/bench?n={n}", headers=berth.headers())
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"bench: {resp.status} {data!r}\n{berth.tail_log()}")
    print(data.decode())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--berth", default="target/release/berth")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--level", choices=["user", "sandbox", "pods"], default="user")
    ap.add_argument("--double", default="target/release/examples/apiserver-double")
    ap.add_argument("--inner", action="store_true")
    args = ap.parse_args()
    args.berth = os.path.abspath(args.berth)
    args.double = os.path.abspath(args.double)
    if args.inner:
        return inner(args)
    server = None
    try:
        server = setup()
        # `ip netns exec` without its /sys remount, which would hide the
        # cgroups a sandbox needs: the namespace's hosts file in a mount
        # namespace of the run's own, then its network namespace.
        enter = (f"mount --bind /etc/netns/{HOST_NS}/hosts /etc/hosts && "
                 f"exec nsenter --net=/run/netns/{HOST_NS} \"$@\"")
        out = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", enter, "sh",
             sys.executable, os.path.abspath(__file__), "--inner", "--berth", args.berth,
             "--n", str(args.n), "--level", args.level, "--double", args.double],
            check=True, stdout=subprocess.PIPE).stdout
    finally:
        teardown(server)
    timings = json.loads(out.decode().strip().splitlines()[-1])
    print(f"{'path':<8} {'n':>6} {'median µs':>10} {'p95 µs':>8} {'p99 µs':>8}")
    for path in ("direct", "proxy"):
        xs = timings[path]
        print(f"{path:<8} {len(xs):>6} {pct(xs, 0.5):>10.0f} {pct(xs, 0.95):>8.0f} "
              f"{pct(xs, 0.99):>8.0f}")
    added = pct(timings["proxy"], 0.5) - pct(timings["direct"], 0.5)
    print(f"added by the egress proxy (median): {added:.0f} µs")


if __name__ == "__main__":
    main()
