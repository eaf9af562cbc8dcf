#!/usr/bin/env python3
"""Spawn benchmarks (single node), standard library only.

    python3 bench/spawn.py spawn-to-ready [--runs 50]
    python3 bench/spawn.py concurrent     [--users 200]
    python3 bench/spawn.py all
    python3 bench/spawn.py isolation      [--runs 50]   # as root

Each benchmark compares berth with the same program started directly:

* spawn-to-ready: POST /api/v1/users/<u>/instance (wait=true) for a fresh
  user, timed from sending the request to receiving the 201; versus
  spawning `berth demo-app --port P` and reading its token line.
* concurrent: N POSTs for N new users at once, wall time until all N are
  ready; versus N `demo-app`s started at once, until every token line.
* isolation: spawn-to-ready through the API at each isolation level
  (`none`, `user`, `sandbox`), one berth per level, the levels taking
  turns launch by launch so that load on the machine falls on all three
  alike; reports each level's median and its overhead over `none`.

spawn-to-ready and concurrent run berth at `--isolation` (default `none`,
so their numbers stay comparable with those before isolation existed).

The binary is taken as given (default target/release/berth); nothing is
built here. Every run uses a fresh temp data dir, and every process it
starts is cleaned up, on success, failure and Ctrl-C alike: users are
stopped through the API, berth gets SIGTERM (then SIGKILL), and any shim or
program still named in <data_dir>/run/*/*.json is killed.
"""

import argparse
import concurrent.futures
import contextlib
import glob
import hashlib
import http.client
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN_LINE = re.compile(rb"berth-demo: http://127\.0\.0\.1:\d+/\?token=[A-Za-z0-9_-]+")
LISTENING = re.compile(r"berth: listening on http://127\.0\.0\.1:(\d+)")
# Separate port ranges, so the direct runs never collide with berth's; both
# below the kernel's ephemeral range (32768+), where the client sockets of
# this very benchmark would otherwise take ports from under the programs.
BERTH_PORTS = (30000, 30999)
DIRECT_PORTS = (31000, 31999)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Process hygiene


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_is_berth(pid, exe):
    """Guards against killing a reused pid: only processes running `exe`."""
    try:
        return os.path.realpath(f"/proc/{pid}/exe") == os.path.realpath(exe)
    except OSError:
        return False


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def pss_kib(pid):
    """Proportional set size: shared pages (the berth binary every shim and
    program maps) split among the processes that map them, so a sum over
    processes does not count them many times over."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_ms(pid):
    """CPU time a process's live threads have used so far: schedstat counts
    nanoseconds, where /proc/<pid>/stat counts 10 ms ticks, too coarse for
    a process that starts in 2 ms. (Threads that already exited are not
    counted; the process's own stat still has them, in ticks.)"""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e6


def hwm_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class DirectProcs:
    """Every `demo-app` this script starts directly, for cleanup."""

    def __init__(self):
        self.lock = threading.Lock()
        self.procs = []

    def add(self, proc):
        with self.lock:
            self.procs.append(proc)

    def kill(self, proc):
        try:
            proc.kill()
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (proc.stdout, proc.stderr):
            if pipe:
                pipe.close()

    def kill_all(self):
        with self.lock:
            procs, self.procs = self.procs, []
        for proc in procs:
            self.kill(proc)


DIRECT = DirectProcs()


class Berth:
    """One `berth serve` on a temp data dir; a context manager that always
    leaves no process behind."""

    def __init__(self, exe, keep=False, parent=None, isolation="none", ports=BERTH_PORTS, base_uid=200000,
                 instance_extra="", reap_extra="idle_ttl_s = 0\n", isolation_extra="", uid_count=10000,
                 top_extra="", tables_extra=""):
        self.exe = exe
        # Extra top-level keys, and extra tables after the others
        # (bench/egress.py's pods).
        self.top_extra = top_extra
        self.tables_extra = tables_extra
        # Extra lines for the [instance] and [reap] tables (bench/resume.py).
        self.instance_extra = instance_extra
        self.reap_extra = reap_extra
        # Extra lines for the [isolation] table (bench/egress.py).
        self.isolation_extra = isolation_extra
        # Every user ever launched keeps an account: at least one per user.
        self.uid_count = uid_count
        self.keep = keep
        self.isolation = isolation
        self.ports = ports
        self.base_uid = base_uid
        self.dir = tempfile.mkdtemp(prefix="berth-bench-", dir=parent)
        # Instance accounts (levels user and sandbox) pass through it to
        # their data roots.
        os.chmod(self.dir, 0o711)
        self.data = os.path.join(self.dir, "data")
        self.proc = None
        self.port = None
        self.token = None
        self.users = set()
        self.users_lock = threading.Lock()

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self):
        config = os.path.join(self.dir, "berth.toml")
        with open(config, "w") as f:
            f.write(
                f'listen = "127.0.0.1:0"\n'
                f'data_dir = "{self.data}"\n'
                f'log_format = "text"\n'
                f"{self.top_extra}"
                f"[instance]\n"
                f"port_range = [{self.ports[0]}, {self.ports[1]}]\n"
                f"{self.instance_extra}"
                f"[reap]\n"
                f"{self.reap_extra}"
                f"[isolation]\n"
                f'mode = "{self.isolation}"\n'
                f"base_uid = {self.base_uid}\n"
                f"uid_count = {self.uid_count}\n"
                f"{self.isolation_extra}"
                f"{self.tables_extra}"
            )
        # berth refuses a config that holds a secret and others may read.
        os.chmod(config, 0o600)
        self.log_path = os.path.join(self.dir, "berth.log")
        out = open(self.log_path, "wb")
        # Own session: a Ctrl-C in the terminal reaches only this script,
        # which then stops the users first and berth last.
        self.proc = subprocess.Popen(
            [self.exe, "serve", "--config", config],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                m = LISTENING.search(f.read().decode(errors="replace"))
            if m:
                self.port = int(m.group(1))
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"berth exited at start:\n{self.tail_log()}")
            time.sleep(0.02)
        else:
            raise RuntimeError(f"berth did not start in 30 s:\n{self.tail_log()}")
        with open(os.path.join(self.data, "admin.token")) as f:
            self.token = f.read().strip()

    def tail_log(self, n=30):
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def connection(self):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)

    def headers(self):
        return {"Authorization": f"Bearer {self.token}", "Content-Length": "0"}

    def path(self, user):
        return f"/api/v1/users/{user}/instance"

    def note_user(self, user):
        with self.users_lock:
            self.users.add(user)

    def launch(self, conn, user):
        """POST with wait=true; returns (status, body, seconds)."""
        self.note_user(user)
        t0 = time.perf_counter()
        conn.request("POST", self.path(user), headers=self.headers())
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, body, time.perf_counter() - t0

    def stop(self, conn, user):
        conn.request("DELETE", self.path(user), headers=self.headers())
        resp = conn.getresponse()
        resp.read()
        if resp.status == 204:
            with self.users_lock:
                self.users.discard(user)
        return resp.status

    def stop_all(self, workers=16):
        with self.users_lock:
            users = sorted(self.users)
        if not users or self.proc is None or self.proc.poll() is not None:
            return

        def one(user):
            try:
                conn = self.connection()
                try:
                    return self.stop(conn, user)
                finally:
                    conn.close()
            except (OSError, http.client.HTTPException) as e:
                return repr(e)

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, users))

    def shims(self):
        """(shim_pid, pid) of every state file under run/."""
        found = []
        for path in glob.glob(os.path.join(self.data, "run", "*", "*.json")):
            try:
                with open(path) as f:
                    state = json.load(f)
            except (OSError, ValueError):
                continue
            found.append((state.get("shim_pid"), state.get("pid")))
        return found

    def tag(self):
        """The 8 hex digits that name this berth's nftables table and
        cgroup parents (a hash of its canonical data dir)."""
        return hashlib.sha256(os.path.realpath(self.data).encode()).hexdigest()[:8]

    def table(self):
        return f"berth_{self.tag()}"

    def cgroup_parents(self):
        """This berth's cgroup parent directories that exist, in every
        hierarchy this process belongs to (berth runs in the same ones)."""
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
        found = []
        for line in lines:
            _, controllers, path = line.split(":", 2)
            for mount in controllers.split(",") + [controllers]:
                parent = os.path.realpath(os.path.join(
                    "/sys/fs/cgroup", mount or "unified", path.lstrip("/"), f"berth-{self.tag()}"))
                if os.path.isdir(parent) and parent not in found:
                    found.append(parent)
        return found

    def instance_cgroups(self):
        return [leaf for parent in self.cgroup_parents()
                for leaf in glob.glob(os.path.join(parent, "*", ""))]

    def remove_isolation_leftovers(self):
        subprocess.run(["nft", "delete", "table", "inet", self.table()],
                       stderr=subprocess.DEVNULL, check=False)
        for leaf in self.instance_cgroups():
            try:
                os.rmdir(leaf)
            except OSError:
                pass
        for parent in self.cgroup_parents():
            try:
                os.rmdir(parent)
            except OSError:
                pass

    def close(self):
        # 1. Stop the users the normal way (instances outlive berth).
        try:
            self.stop_all()
        except BaseException as e:  # keep cleaning up even on a 2nd Ctrl-C
            log(f"bench: stopping users: {e!r}")
        # 2. berth itself.
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # 3. Anything left behind: shims and their programs.
        for shim_pid, pid in self.shims():
            for p in (shim_pid, pid):
                if isinstance(p, int) and p > 0 and pid_alive(p) and pid_is_berth(p, self.exe):
                    log(f"bench: killing leftover process {p}")
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass
        # 4. What berth leaves in the kernel on purpose when it stops (its
        # instances outlive it, guarded and limited): its nftables table
        # and its cgroups.
        if self.isolation != "none":
            self.remove_isolation_leftovers()
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            log(f"bench: kept {self.dir}")


# --------------------------------------------------------------------------
# Direct starts


@contextlib.contextmanager
def api_server_double(double_exe):
    """The API-server double (`berth-k8s`'s `apiserver-double` example)
    running until the block ends: yields the path of its kubeconfig, in a
    searchable temporary directory under /var/tmp."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        os.chmod(tmp, 0o755)
        kubeconfig = os.path.join(tmp, "kubeconfig")
        double = subprocess.Popen([double_exe, "--kubeconfig", kubeconfig],
                                  stdout=subprocess.PIPE, start_new_session=True)
        try:
            double.stdout.readline()
            yield kubeconfig
        finally:
            os.killpg(double.pid, signal.SIGTERM)
            double.wait()


def free_port(candidates):
    """The first port of `candidates` that binds (as the programs bind it:
    with SO_REUSEADDR)."""
    for port in candidates:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    raise RuntimeError("no free port for the direct run")


def direct_env():
    # What berth hands the program by default: the allow-listed variables.
    return {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TZ")}


def direct_start(exe, port, env):
    """Spawns demo-app and reads its token line; returns (proc, seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [exe, "demo-app", "--port", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    DIRECT.add(proc)
    while True:
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read().decode(errors="replace").strip()
            raise RuntimeError(f"demo-app on port {port} exited without its token line: {err}")
        if TOKEN_LINE.search(line):
            return proc, time.perf_counter() - t0


# --------------------------------------------------------------------------
# Benchmarks


def ms(seconds):
    return seconds * 1000.0


def summary(samples):
    xs = sorted(samples)
    p95 = xs[min(len(xs) - 1, max(0, round(0.95 * len(xs)) - 1))]
    return {
        "n": len(xs),
        "median_ms": round(ms(statistics.median(xs)), 2),
        "p95_ms": round(ms(p95), 2),
        "min_ms": round(ms(xs[0]), 2),
        "max_ms": round(ms(xs[-1]), 2),
    }


def bench_spawn_to_ready(args):
    runs, warmup = args.runs, args.warmup
    api = []
    with Berth(args.berth, keep=args.keep, parent=args.tmp, isolation=args.isolation) as berth:
        conn = berth.connection()
        for i in range(warmup + runs):
            user = f"s{i}"
            status, body, secs = berth.launch(conn, user)
            if status != 201:
                raise RuntimeError(f"POST {user}: {status} {body[:300]!r}")
            if not json.loads(body)["instance"]["ready"]:
                raise RuntimeError(f"POST {user}: 201 but not ready: {body[:300]!r}")
            if i >= warmup:
                api.append(secs)
            status = berth.stop(conn, user)
            if status != 204:
                raise RuntimeError(f"DELETE {user}: {status}")
        conn.close()
    direct = []
    env = direct_env()
    ports = iter(range(*DIRECT_PORTS))
    for i in range(warmup + runs):
        proc, secs = direct_start(args.berth, free_port(ports), env)
        if i >= warmup:
            direct.append(secs)
        DIRECT.kill(proc)
    a, d = summary(api), summary(direct)
    return {
        "bench": "spawn-to-ready",
        "runs": runs,
        "api": a,
        "direct": d,
        "overhead_median_ms": round(a["median_ms"] - d["median_ms"], 2),
        "overhead_p95_ms": round(a["p95_ms"] - d["p95_ms"], 2),
    }


def bench_isolation(args):
    """spawn-to-ready at each isolation level, the levels taking turns."""
    if os.geteuid() != 0:
        raise RuntimeError("isolation levels user and sandbox need root")
    levels = ["none", "user", "sandbox"]
    samples = {level: [] for level in levels}
    with contextlib.ExitStack() as stack:
        berths = {}
        for i, level in enumerate(levels):
            # Port blocks and account ranges of their own.
            ports = (BERTH_PORTS[0] + 300 * i, BERTH_PORTS[0] + 300 * i + 299)
            berths[level] = stack.enter_context(
                Berth(args.berth, keep=args.keep, parent=args.tmp, isolation=level,
                      ports=ports, base_uid=700000 + 10000 * i)
            )
        conns = {level: berths[level].connection() for level in levels}
        for i in range(args.warmup + args.runs):
            for level in levels:
                berth, conn, user = berths[level], conns[level], f"i{i}"
                status, body, secs = berth.launch(conn, user)
                if status != 201 or not json.loads(body)["instance"]["ready"]:
                    raise RuntimeError(f"{level}: POST {user}: {status} {body[:300]!r}")
                if i >= args.warmup:
                    samples[level].append(secs)
                if berth.stop(conn, user) != 204:
                    raise RuntimeError(f"{level}: DELETE {user} failed")
        for conn in conns.values():
            conn.close()
    result = {"bench": "isolation", "runs": args.runs}
    for level in levels:
        result[level] = summary(samples[level])
    for level in levels[1:]:
        result[f"{level}_overhead_median_ms"] = round(
            result[level]["median_ms"] - result["none"]["median_ms"], 2
        )
    return result


def run_at_once(n, fn, barrier):
    """Runs fn(0..n) on n threads released together by `barrier` (n + 1
    parties); returns (release time, results in order)."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(fn, i) for i in range(n)]
        try:
            barrier.wait(timeout=60)
        except BaseException:
            # Ctrl-C before the start: free the waiting threads, or the
            # pool's shutdown would wait on them forever.
            barrier.abort()
            raise
        t0 = time.perf_counter()
        return t0, [f.result() for f in futures]


def bench_concurrent(args):
    n = args.users
    result = {"bench": "concurrent", "users": n}
    with Berth(args.berth, keep=args.keep, parent=args.tmp, isolation=args.isolation) as berth:
        barrier = threading.Barrier(n + 1)
        conns = [berth.connection() for _ in range(n)]
        for c in conns:
            c.connect()  # connected before the clock starts

        def one(i):
            user = f"c{i}"
            barrier.wait(timeout=60)
            try:
                status, body, secs = berth.launch(conns[i], user)
            except (OSError, http.client.HTTPException) as e:
                return (user, None, repr(e), time.perf_counter(), None)
            ok = status == 201 and json.loads(body)["instance"]["ready"]
            return (user, ok, f"{status} {body[:200]!r}", time.perf_counter(), secs)

        berth_cpu0 = cpu_ms(berth.proc.pid)
        t0, results = run_at_once(n, one, barrier)
        wall = max(r[3] for r in results) - t0
        berth_cpu = cpu_ms(berth.proc.pid) - berth_cpu0
        failures = [r for r in results if not r[1]]
        for c in conns:
            c.close()
        shims = berth.shims()
        latencies = [r[4] for r in results if r[1]]
        result["api"] = {
            "wall_ms": round(ms(wall), 1),
            "failures": len(failures),
            "request": summary(latencies) if latencies else None,
            "berth_rss_mib": round(rss_kib(berth.proc.pid) / 1024, 1),
            "berth_peak_rss_mib": round(hwm_kib(berth.proc.pid) / 1024, 1),
            "berth_cpu_ms": round(berth_cpu),
            "shims_cpu_ms": round(sum(cpu_ms(s) for s, _ in shims if s)),
            "programs_cpu_ms": round(sum(cpu_ms(p) for _, p in shims if p)),
            "shims": len(shims),
            "shims_rss_mib": round(sum(rss_kib(s) for s, _ in shims if s) / 1024, 1),
            "shims_pss_mib": round(sum(pss_kib(s) for s, _ in shims if s) / 1024, 1),
            "programs_rss_mib": round(sum(rss_kib(p) for _, p in shims if p) / 1024, 1),
            "programs_pss_mib": round(sum(pss_kib(p) for _, p in shims if p) / 1024, 1),
        }
        for user, _, why, _, _ in failures[:5]:
            log(f"bench: {user} failed: {why}")
    # Let the box settle (stopped programs, freed ports) before the direct run.
    time.sleep(1)
    env = direct_env()
    candidates = iter(range(DIRECT_PORTS[0], DIRECT_PORTS[1] + 1))
    ports = [free_port(candidates) for _ in range(n)]
    barrier = threading.Barrier(n + 1)

    def start(i):
        barrier.wait(timeout=60)
        try:
            proc, _ = direct_start(args.berth, ports[i], env)
            return (proc, time.perf_counter())
        except (OSError, RuntimeError) as e:
            return (None, time.perf_counter(), repr(e))

    try:
        t0, results = run_at_once(n, start, barrier)
        wall = max(r[1] for r in results) - t0
        procs = [r[0] for r in results if r[0] is not None]
        for r in [r for r in results if r[0] is None][:5]:
            log(f"bench: direct start failed: {r[2]}")
        result["direct"] = {
            "wall_ms": round(ms(wall), 1),
            "failures": n - len(procs),
            "programs_rss_mib": round(sum(rss_kib(p.pid) for p in procs) / 1024, 1),
            "programs_pss_mib": round(sum(pss_kib(p.pid) for p in procs) / 1024, 1),
            "programs_cpu_ms": round(sum(cpu_ms(p.pid) for p in procs)),
        }
    finally:
        DIRECT.kill_all()
    result["ratio"] = round(result["api"]["wall_ms"] / result["direct"]["wall_ms"], 3)
    return result


def machine():
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "loadavg": [round(x, 2) for x in load] if load else None,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", choices=["spawn-to-ready", "concurrent", "all", "isolation"])
    parser.add_argument(
        "--isolation",
        default="none",
        choices=["none", "user", "sandbox"],
        help="spawn-to-ready, concurrent: berth's isolation level (default none)",
    )
    parser.add_argument(
        "--berth",
        default=os.path.join(REPO, "target", "release", "berth"),
        help="the release binary (default: target/release/berth)",
    )
    parser.add_argument("--runs", type=int, default=50, help="spawn-to-ready: timed runs per side")
    parser.add_argument("--warmup", type=int, default=3, help="spawn-to-ready: untimed runs first")
    parser.add_argument("--users", type=int, default=200, help="concurrent: users at once")
    parser.add_argument("--keep", action="store_true", help="keep the temp data dir (berth.log)")
    parser.add_argument(
        "--tmp",
        default=None,
        help="where the per-run temp data dir is made (default: the system temp dir, $TMPDIR)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    args.berth = os.path.abspath(args.berth)
    if not os.access(args.berth, os.X_OK):
        sys.exit(f"bench: {args.berth} is not executable; run `cargo build --release -p berth` first")

    # SIGTERM takes the same cleanup path as Ctrl-C.
    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # Also when started with SIGINT ignored (a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    results = {"machine_before": machine()}
    try:
        if args.bench in ("spawn-to-ready", "all"):
            results["spawn_to_ready"] = bench_spawn_to_ready(args)
        if args.bench in ("concurrent", "all"):
            results["concurrent"] = bench_concurrent(args)
        if args.bench == "isolation":
            results["isolation"] = bench_isolation(args)
    except KeyboardInterrupt:
        log("bench: interrupted; cleaned up")
        return 130
    finally:
        DIRECT.kill_all()
    results["machine_after"] = machine()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(json.dumps(results, indent=2))
    s = results.get("spawn_to_ready")
    if s:
        print(
            f"\nspawn-to-ready ({s['runs']} runs): API median {s['api']['median_ms']} ms "
            f"p95 {s['api']['p95_ms']} ms | direct median {s['direct']['median_ms']} ms "
            f"p95 {s['direct']['p95_ms']} ms | berth adds {s['overhead_median_ms']} ms at the median"
        )
    iso = results.get("isolation")
    if iso:
        print(
            f"\nisolation spawn-to-ready ({iso['runs']} runs each), median (p95): "
            f"none {iso['none']['median_ms']} ms ({iso['none']['p95_ms']}) | "
            f"user {iso['user']['median_ms']} ms ({iso['user']['p95_ms']}), "
            f"+{iso['user_overhead_median_ms']} ms | "
            f"sandbox {iso['sandbox']['median_ms']} ms ({iso['sandbox']['p95_ms']}), "
            f"+{iso['sandbox_overhead_median_ms']} ms"
        )
    c = results.get("concurrent")
    if c:
        a, d = c["api"], c["direct"]
        print(
            f"concurrent ({c['users']} users): API {a['wall_ms']} ms, {a['failures']} failures, "
            f"berth RSS {a['berth_rss_mib']} MiB, {a['shims']} shims RSS {a['shims_rss_mib']} MiB "
            f"(PSS {a['shims_pss_mib']} MiB) | "
            f"direct {d['wall_ms']} ms, {d['failures']} failures | ratio {c['ratio']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
