#!/usr/bin/env python3
"""Scale benchmark of one node, standard library only.

    sudo python3 bench/scale.py [--n 100,1000] [--isolation user] [--launchers 16]

For each N, one `berth serve` (isolation `user` by default, the default
as root; port range of N + 50 ports, so its capacity holds N) runs the
built-in demo app for N users, and the script measures:

* launch: N launches through the API (`wait=true`) from `--launchers`
  client threads; wall time, launches per second overall and over the
  last tenth of them (the rate with nearly N running), failures;
* churn (N of at least 1,000): the launch rate with a steady number
  running, once at 100 (before the rest are launched) and once at N:
  `--churn` times, a client thread stops one of its running users and
  launches a new one in its place. Each launch then reuses memory another
  instance just gave back, as on a node where users come and go, so the
  two rates compare berth's cost at 100 and at N, not the cost of memory
  touched for the first time (which, in a VM, can grow with the memory in
  use: bench/page_touch.py);
* while all N run: berth's RSS, the shims' and programs' PSS per
  instance, and `/healthz` latency (median and p99 of 500 sequential
  GETs);
* re-adoption: `kill -9` of berth, then a new berth on the same data dir;
  the time from its start to its listening line, the time to its
  "adoption ended" line with `/healthz` asked all the while (berth serves
  while it adopts), berth's RSS then and 2 s later, and a check that all
  N are running with the pids they had (and berth's RSS right after that
  listing, and 11 s later, once berth has given freed memory back);
* stop: every user stopped through the API (16 client threads); wall time;
* leftovers: shims and programs still alive, port-guard elements and
  instance cgroups left once all are stopped (all must be 0).

N of 10,000 needs `kernel.pid_max` above 5 per instance (sysctl
kernel.pid_max=4194304) and berth's open-files limit above 3 per instance
(`ulimit -n`); berth warns at start when they are short.

The binary is taken as given (default target/release/berth); nothing is
built here. Every process started is cleaned up (see bench/spawn.py).
"""

import argparse
import concurrent.futures
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spawn  # noqa: E402  (the Berth harness, shared with the spawn bench)


def rate(times):
    """Launches per second over `times` (sorted completion times)."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def launch_all(berth, users, launchers, running=0):
    """Launches every user, with `running` running already; returns (wall
    seconds, failures, the rate of the last tenth of the launches: the rate
    with nearly all running, and the rate of the launches that find 100 to
    600 running, when there are at least 1,000)."""
    done = []

    def one(chunk):
        failed = []
        conn = berth.connection()
        try:
            for user in chunk:
                status, body, _ = berth.launch(conn, user)
                done.append(time.perf_counter())
                if status != 201:
                    failed.append((user, status, body[:200].decode(errors="replace")))
        finally:
            conn.close()
        return failed

    chunks = [users[i::launchers] for i in range(launchers)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(launchers) as pool:
        failures = [f for failed in pool.map(one, chunks) for f in failed]
    done.sort()
    tenth = max(len(done) // 10, 1)
    skip = max(100 - running, 0)
    early = rate(done[skip:skip + 500]) if len(done) >= 1000 else None
    return time.perf_counter() - start, failures, rate(done[-tenth:]), early


def churn(berth, running, pairs, launchers, prefix):
    """`pairs` times, stops a user of `running` and launches a new user
    (named `prefix` and a number) in its place, from `launchers` threads,
    each with its own share of `running`. Returns (stop-and-launch pairs
    per second, failures, the users running now)."""
    shares = [running[i::launchers] for i in range(launchers)]
    per_thread = [pairs // launchers + (1 if i < pairs % launchers else 0)
                  for i in range(launchers)]

    def one(t):
        own, failed, conn = list(shares[t]), [], berth.connection()
        try:
            for k in range(per_thread[t]):
                if not own:
                    break
                old, new = own.pop(0), f"{prefix}{t}x{k}"
                stopped = berth.stop(conn, old)
                status, body, _ = berth.launch(conn, new)
                if stopped != 204 or status != 201:
                    failed.append((old, stopped, new, status, body[:200].decode(errors="replace")))
                own.append(new)
        finally:
            conn.close()
        return own, failed

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(launchers) as pool:
        results = list(pool.map(one, range(launchers)))
    seconds = time.perf_counter() - start
    now = [u for own, _ in results for u in own]
    failures = [f for _, failed in results for f in failed]
    return pairs / seconds, failures, now


def healthz(berth, n=500):
    conn = berth.connection()
    times = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            conn.request("GET", "/healthz")
            resp = conn.getresponse()
            resp.read()
            times.append(time.perf_counter() - start)
            if resp.status != 200:
                raise RuntimeError(f"/healthz answered {resp.status}")
    finally:
        conn.close()
    times.sort()
    return {
        "median_ms": round(statistics.median(times) * 1000, 3),
        "p99_ms": round(times[int(len(times) * 0.99) - 1] * 1000, 3),
    }


def running_mains(berth):
    conn = berth.connection()
    try:
        conn.request("GET", "/api/v1/instances?status=running", headers=berth.headers())
        resp = conn.getresponse()
        listed = json.loads(resp.read())
    finally:
        conn.close()
    return {i["user"]: i.get("pid") for i in listed["instances"] if i["role"] == "main"}


def await_adoption(berth, start, patience=600):
    """Waits for berth's "adoption ended" line, asking `/healthz` all the
    while; returns (seconds from `start` to that line, the `/healthz`
    answers meanwhile: count, failures, median and p99). A kept-alive
    connection berth closed is asked again on a new one: only a request
    that fails on a fresh connection counts as a failure."""
    times, failures = [], 0
    conn = berth.connection()
    deadline = time.monotonic() + patience
    log = open(berth.log_path, "rb")
    seen = b""

    def ask(conn):
        t0 = time.perf_counter()
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.perf_counter() - t0

    try:
        while time.monotonic() < deadline:
            # The tail of the last read too: the line may come in two.
            seen = seen[-32:] + log.read()
            if b"adoption ended" in seen:
                ended = time.perf_counter() - start
                break
            try:
                status, took = ask(conn)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                conn.close()
                conn = berth.connection()
                try:
                    status, took = ask(conn)
                except OSError:
                    failures += 1
                    conn.close()
                    conn = berth.connection()
                    continue
            except OSError:
                failures += 1
                conn.close()
                conn = berth.connection()
                continue
            failures += status != 200
            times.append(took)
        else:
            raise RuntimeError(f"adoption did not end in {patience} s")
    finally:
        conn.close()
        log.close()
    times.sort()
    answers = {"count": len(times), "failures": failures}
    if times:
        answers["median_ms"] = round(statistics.median(times) * 1000, 3)
        answers["p99_ms"] = round(times[max(int(len(times) * 0.99) - 1, 0)] * 1000, 3)
    return round(ended, 2), answers


def instance_pss_kib(berth):
    pids = [p for pair in berth.shims() for p in pair if isinstance(p, int) and p > 0]
    return sum(spawn.pss_kib(p) for p in pids)


def port_guard_elements(berth):
    out = subprocess.run(
        ["nft", "-j", "list", "set", "inet", berth.table(), "own_ports"],
        capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return 0
    for item in json.loads(out.stdout)["nftables"]:
        if "set" in item:
            return len(item["set"].get("elem", []))
    return 0


def live_instance_processes(berth, patience=30):
    """Shims and programs still alive once every stop answered: a shim
    ends a moment after its program, so this waits up to `patience`
    seconds for them to be gone."""
    deadline = time.monotonic() + patience
    while True:
        alive = sum(1 for pair in berth.shims() for p in pair
                    if isinstance(p, int) and p > 0 and spawn.pid_alive(p))
        if alive == 0 or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def one_scale(args, n):
    # Below the kernel's ephemeral range (32768+), whose ports the
    # script's own client sockets take, up to N of 12,700.
    ports = (20000, 20000 + n + 49)
    # Nothing is reaped or hibernated: a launch of 10,000 outlasts the idle
    # time, and every instance must still run when it is counted.
    reap = "idle_ttl_s = 0\nhibernate_after_s = 0\n"
    # Each churn pair launches a user who never ran: an account more.
    accounts = max(10000, n + 2 * args.churn)
    with spawn.Berth(args.berth, isolation=args.isolation, ports=ports, base_uid=args.base_uid,
                     parent=args.tmp, reap_extra=reap, uid_count=accounts) as berth:
        users = [f"scale{i}" for i in range(n)]
        row = {"n": n, "isolation": args.isolation, "machine_before": spawn.machine()}
        steady = n >= 1000 and args.churn > 0
        if steady:
            _, failures, _, _ = launch_all(berth, users[:100], args.launchers)
            at_100, churn_failures, first = churn(berth, users[:100], args.churn,
                                                  args.launchers, "early")
            failures += churn_failures
            users = first + users[100:]
        seconds, launch_failures, late_rate, early_rate = launch_all(
            berth, users[100:] if steady else users, args.launchers, 100 if steady else 0)
        if steady:
            at_n, churn_failures, users = churn(berth, users, args.churn, args.launchers, "late")
            failures += launch_failures + churn_failures
            row["churn"] = {"pairs": args.churn, "at_100_per_s": round(at_100, 1),
                            f"at_{n}_per_s": round(at_n, 1), "ratio": round(at_100 / at_n, 2)}
        else:
            failures = launch_failures
        launched = n - 100 if steady else n
        row["launch"] = {"seconds": round(seconds, 2), "per_s": round(launched / seconds, 1),
                         "last_tenth_per_s": late_rate and round(late_rate, 1),
                         "launches_100_to_600_per_s": early_rate and round(early_rate, 1),
                         "failures": len(failures), "first_failures": failures[:3]}
        spawn.log(f"scale: {n} launched in {seconds:.1f} s ({n / seconds:.1f}/s), "
                  f"{len(failures)} failed")
        row["berth_rss_mib"] = round(spawn.rss_kib(berth.proc.pid) / 1024, 1)
        row["pss_per_instance_kib"] = round(instance_pss_kib(berth) / n)
        row["healthz"] = healthz(berth)
        before = running_mains(berth)

        berth.proc.send_signal(signal.SIGKILL)
        berth.proc.wait()
        start = time.perf_counter()
        berth.start()
        row["listening_s"] = round(time.perf_counter() - start, 2)
        row["readopt_s"], row["healthz_while_adopting"] = await_adoption(berth, start)
        # Before the listing below: its answer (every instance's record)
        # is the largest thing berth builds, and would count here. Taken
        # as the adoption ends, and again once berth has given the heap the
        # adoption freed back (it does so right after).
        row["berth_rss_after_readopt_mib"] = round(spawn.rss_kib(berth.proc.pid) / 1024, 1)
        time.sleep(2)
        row["berth_rss_settled_mib"] = round(spawn.rss_kib(berth.proc.pid) / 1024, 1)
        after = running_mains(berth)
        row["readopted"] = sum(1 for u, pid in before.items() if after.get(u) == pid)
        row["berth_rss_after_listing_mib"] = round(spawn.rss_kib(berth.proc.pid) / 1024, 1)
        # berth gives freed memory back every 10 s (serve/heap.rs).
        time.sleep(11)
        row["berth_rss_listing_settled_mib"] = round(spawn.rss_kib(berth.proc.pid) / 1024, 1)
        spawn.log(f"scale: re-adopted {row['readopted']} of {len(before)} in "
                  f"{row['readopt_s']} s")

        start = time.perf_counter()
        berth.stop_all(workers=16)
        row["stop_all_s"] = round(time.perf_counter() - start, 2)
        row["left"] = {
            "processes": live_instance_processes(berth),
            "port_guard_elements": port_guard_elements(berth) if args.isolation != "none" else 0,
            "instance_cgroups": len(berth.instance_cgroups()),
        }
        row["machine_after"] = spawn.machine()
        if args.keep_log:
            os.makedirs(args.keep_log, exist_ok=True)
            shutil.copy(berth.log_path, os.path.join(args.keep_log, f"berth-{n}.log"))
        return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", default="100,1000", help="comma-separated instance counts")
    parser.add_argument("--isolation", default="user", choices=["none", "user", "sandbox"])
    parser.add_argument("--launchers", type=int, default=16, help="client threads launching")
    parser.add_argument("--churn", type=int, default=1000,
                        help="stop-and-launch pairs at 100 and at N running (0: none)")
    parser.add_argument("--berth", default=os.path.join(spawn.REPO, "target/release/berth"))
    parser.add_argument("--base-uid", type=int, default=600000)
    parser.add_argument("--tmp", default=None, help="where the data dir is made")
    parser.add_argument("--keep-log", default=None,
                        help="a directory to copy berth's log of the re-adoption run to")
    args = parser.parse_args()
    if args.isolation != "none" and os.geteuid() != 0:
        sys.exit("scale: isolation levels user and sandbox need root")
    rows = [one_scale(args, int(n)) for n in args.n.split(",")]
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
