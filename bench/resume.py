#!/usr/bin/env python3
"""Hibernation benchmark (single node), standard library only.

    python3 bench/resume.py [--berth target/release/berth] [--rounds 50] [--users 100]
    python3 bench/resume.py --runtime pods [--double target/release/examples/apiserver-double]

Measures, in one run, with berth at isolation `none`:

* resume-to-first-byte, 1 user: alice (demo-app) is hibernated through the
  API (`POST …/instance/hibernate`), the script waits until the kernel shows
  her process stopped (/proc/<pid>/stat state `T`), then times a
  `GET /u/alice/` from sending it to its status line; `--rounds` times;
* the same for `--users` hibernated users woken at once: one thread per
  user, released together, each timing its own GET; 5 rounds; and, as a
  control, the same GETs to the same users awake (what this Python client
  and the proxy cost without any resume), and single GETs to awake alice;
* resume-to-first-byte of Jupyter Server (`GET /u/<u>/api`), `--rounds`
  times, the same way;
* cold start of the same apps: a `GET` for a user with no instance, from
  sending it to its status line (berth launches, waits for ready, then
  forwards): demo-app `--rounds` times, Jupyter Server 10 times.

With `--runtime pods` (as root), berth runs on the Kubernetes runtime
with berth's shim as each pod's entrypoint (this same binary), against
the API-server double (`--double`, built with `cargo build --release -p
berth-k8s --features test-double --example apiserver-double`), whose
stand-in kubelet runs each pod's shim as a local process: the demo-app
rows only (1 user, the awake control, cold start). A pod's program is
found by its environment (`BERTH_USER`), and frozen means stopped (`T`)
as above; the resume goes through the shim's link (a thaw over TCP, a
sweep of the program's uid).

Jupyter Server is pip-installed into a venv under bench/.venv-jupyter on
first use (PyPI must be reachable). The binary is taken as given; nothing
is built here. Every process started is cleaned up (see bench/spawn.py).
"""

import argparse
import concurrent.futures
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spawn  # noqa: E402  (the Berth harness, shared with the spawn bench)

HERE = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(HERE, ".venv-jupyter")
READY_JUPYTER = r"http://127\.0\.0\.1:\d+/\S*[?&]token=([A-Za-z0-9_-]+)"


def jupyter_bin():
    exe = os.path.join(VENV, "bin", "jupyter")
    if not os.path.exists(exe):
        spawn.log(f"bench: installing jupyter-server into {VENV}")
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
        subprocess.run([os.path.join(VENV, "bin", "pip"), "install", "--quiet",
                        "--disable-pip-version-check", "jupyter-server"], check=True)
    return exe


def jupyter_instance(exe):
    argv = [exe, "server", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
            "--ServerApp.port={port}", "--ServerApp.port_retries=0",
            "--ServerApp.base_url={base_path}", "--ServerApp.root_dir={folder}"]
    return (f"command = {json.dumps(argv)}\n"
            f"ready_token_regex = '{READY_JUPYTER}'\n"
            f"ready_timeout_s = 120\n")


def pct(values, p):
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summary(name, seconds):
    ms = [s * 1000 for s in seconds]
    line = (f"{name:<42} n={len(ms):<4} p50={pct(ms, 50):9.3f} ms  "
            f"p99={pct(ms, 99):9.3f} ms  max={max(ms):9.3f} ms")
    print(line, flush=True)
    return {"name": name, "n": len(ms), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99),
            "max_ms": max(ms), "mean_ms": statistics.mean(ms)}


def first_byte(berth, path):
    """GET `path`; seconds from sending to the status line."""
    conn = berth.connection()
    try:
        t0 = time.perf_counter()
        conn.request("GET", path, headers={"Authorization": f"Bearer {berth.token}"})
        resp = conn.getresponse()
        took = time.perf_counter() - t0
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"GET {path}: {resp.status}")
        return took
    finally:
        conn.close()


def api(berth, method, path):
    conn = berth.connection()
    try:
        conn.request(method, path, headers=berth.headers())
        resp = conn.getresponse()
        body = resp.read()
        if resp.status >= 300:
            raise RuntimeError(f"{method} {path}: {resp.status} {body[:200]!r}")
        return json.loads(body or b"null")
    finally:
        conn.close()


def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def pod_program(user):
    """The pid of `user`'s demo app in a pod on the double: the process
    whose command is the demo app and whose environment names the user."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                # The demo app itself, not its shim (`berth shim pod -- …`).
                if f.read().split(b"\0")[1:2] != [b"demo-app"]:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"BERTH_USER={user}".encode() in f.read().split(b"\0"):
                    return int(entry)
        except OSError:
            continue
    raise RuntimeError(f"no demo app of {user} found")


def hibernate(berth, user):
    answer = api(berth, "POST", f"/api/v1/users/{user}/instance/hibernate")
    pid = answer["instance"].get("pid") or pod_program(user)
    deadline = time.monotonic() + 30
    while state(pid) != "T":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{user} (pid {pid}) not frozen after 30 s")
        time.sleep(0.001)


def launch(berth, user):
    berth.note_user(user)
    api(berth, "POST", f"/api/v1/users/{user}/instance")


def resume_one(berth, user, route, rounds):
    launch(berth, user)
    first_byte(berth, f"/u/{user}/{route}")
    samples = []
    for _ in range(rounds):
        hibernate(berth, user)
        samples.append(first_byte(berth, f"/u/{user}/{route}"))
    return samples


def resume_many(berth, users, rounds, asleep=True):
    """`users` GETs released together, `rounds` times; with `asleep`, every
    user hibernated first (else the control: the same GETs to running
    instances, which is what the client and proxy cost by themselves)."""
    names = [f"u{i:03d}" for i in range(users)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda u: launch(berth, u), names))
    samples = []
    for _ in range(rounds):
        if asleep:
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda u: hibernate(berth, u), names))
        barrier = threading.Barrier(users)

        def wake(user):
            barrier.wait()
            return first_byte(berth, f"/u/{user}/")

        with concurrent.futures.ThreadPoolExecutor(users) as pool:
            samples.extend(pool.map(wake, names))
    return samples


def cold(berth, prefix, route, rounds):
    samples = []
    for i in range(rounds):
        user = f"{prefix}{i:03d}"
        berth.note_user(user)
        samples.append(first_byte(berth, f"/u/{user}/{route}"))
        conn = berth.connection()
        try:
            berth.stop(conn, user)
        finally:
            conn.close()
    return samples


def pods(exe, double_exe, reap, rounds):
    """The demo-app rows with the demo app in pods under berth's shim, on
    the API-server double."""
    command = json.dumps([exe, "demo-app", "--host", "127.0.0.1", "--port", "{port}"])
    with spawn.api_server_double(double_exe) as kubeconfig:
        tables = (f'[kubernetes]\nkubeconfig = "{kubeconfig}"\nimage = "bench.invalid/none:1"\n'
                  f'command = {command}\nendpoint = "endpoint_slice"\n'
                  f'[kubernetes.shim]\npath = "{exe}"\n')
        secret = f'cluster_secret = "{os.urandom(24).hex()}"\n'
        ready = "ready_token_regex = 'berth-demo: http://[0-9.]+:\\d+/\\?token=([A-Za-z0-9_-]+)'\n"
        results = []
        with spawn.Berth(exe, parent="/var/tmp", reap_extra=reap, instance_extra=ready,
                         top_extra=secret, tables_extra=tables) as berth:
            results.append(summary("pods: resume-to-first-byte, demo-app, 1 user",
                                   resume_one(berth, "alice", "", rounds)))
            results.append(summary("pods: control: 1 GET, awake",
                                   [first_byte(berth, "/u/alice/") for _ in range(rounds)]))
            results.append(summary("pods: cold start to first byte, demo-app",
                                   cold(berth, "cold", "", rounds)))
        return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--berth", default=os.path.join(spawn.REPO, "target", "release", "berth"))
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--runtime", choices=["local", "pods"], default="local")
    parser.add_argument("--double", default=os.path.join(
        spawn.REPO, "target", "release", "examples", "apiserver-double"))
    args = parser.parse_args()
    exe = os.path.abspath(args.berth)
    # Hibernation by hand only, never by the reaper.
    reap = "idle_ttl_s = 0\nhibernate_after_s = 0\n"
    print(f"berth {exe}\n{os.cpu_count()} CPUs, {spawn.platform.platform()}\n", flush=True)
    if args.runtime == "pods":
        print(json.dumps(pods(exe, os.path.abspath(args.double), reap, args.rounds), indent=1))
        return
    results = []
    with spawn.Berth(exe, reap_extra=reap) as berth:
        results.append(summary("resume-to-first-byte, demo-app, 1 user",
                               resume_one(berth, "alice", "", args.rounds)))
        results.append(summary(f"resume-to-first-byte, demo-app, {args.users} at once",
                               resume_many(berth, args.users, 5)))
        results.append(summary(f"control: {args.users} GETs at once, all awake",
                               resume_many(berth, args.users, 5, asleep=False)))
        results.append(summary("control: 1 GET, awake",
                               [first_byte(berth, "/u/alice/") for _ in range(args.rounds)]))
        results.append(summary("cold start to first byte, demo-app",
                               cold(berth, "cold", "", args.rounds)))
    jupyter = jupyter_instance(jupyter_bin())
    with spawn.Berth(exe, reap_extra=reap, instance_extra=jupyter) as berth:
        results.append(summary("resume-to-first-byte, Jupyter Server, 1 user",
                               resume_one(berth, "jalice", "api", args.rounds)))
        results.append(summary("cold start to first byte, Jupyter Server",
                               cold(berth, "jcold", "api", 10)))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
