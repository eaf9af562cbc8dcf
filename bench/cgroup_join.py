#!/usr/bin/env python3
"""Times the cgroup work of one launch at `user`, done by hand (as root).

    python3 bench/cgroup_join.py [--rounds 30] [--file tasks|cgroup.procs]

Each round makes one directory per v1 controller berth uses (memory, pids,
cpu, freezer) under this process's own cgroups, forks a child that writes
`0` to the chosen file of each (what the shim's child does before exec),
then removes the directories. On a cgroup v2-only host it makes one
directory in the unified hierarchy and `--file` must be `cgroup.procs`.

`cgroup.procs` moves a whole thread group, for which the kernel write-locks
every thread group on the host and waits for an RCU grace period; `tasks`
(v1 only) moves the calling thread alone, which needs no such lock. A
hierarchy mounted with `favordynmods` makes the kernel use a lock per
thread group instead, for every hierarchy and until the next boot (it
cannot be switched back), after which both files measure alike: check
`grep cgroup /proc/mounts` and this host's history before trusting a
comparison.

Prints medians (min, max) in ms over the rounds.
"""
import argparse
import os
import statistics
import time

V1_CONTROLLERS = ["memory", "pids", "cpu", "freezer"]


def own_cgroups():
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else ["unified"]:
                own[name] = path
    return own


def instance_dirs(tag):
    own = own_cgroups()
    if all(c in own for c in V1_CONTROLLERS):
        return [
            f"/sys/fs/cgroup/{c}{own[c].rstrip('/')}/{tag}" for c in V1_CONTROLLERS
        ]
    return [f"/sys/fs/cgroup{own['unified'].rstrip('/')}/{tag}"]


def join_in_child(dirs, file):
    """Forks a child that joins every dir; returns its time per join."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        times = []
        for d in dirs:
            start = time.perf_counter()
            fd = os.open(os.path.join(d, file), os.O_WRONLY)
            os.write(fd, b"0")
            os.close(fd)
            times.append(time.perf_counter() - start)
        os.write(write, " ".join(map(str, times)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        times = [float(t) for t in f.read().split()]
    os.waitpid(pid, 0)
    return times


def remove(dirs):
    for d in dirs:
        # The child's exit is reaped, but its cgroup may lag a moment.
        for _ in range(1000):
            try:
                os.rmdir(d)
                break
            except OSError:
                time.sleep(0.001)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--file", default="tasks", choices=["tasks", "cgroup.procs"])
    args = parser.parse_args()
    made, first, others, removed = [], [], [], []
    for i in range(args.rounds):
        dirs = instance_dirs(f"bench-cgroup-join-{os.getpid()}-{i}")
        start = time.perf_counter()
        for d in dirs:
            os.mkdir(d)
        made.append(time.perf_counter() - start)
        try:
            times = join_in_child(dirs, args.file)
        finally:
            start = time.perf_counter()
            remove(dirs)
            removed.append(time.perf_counter() - start)
        first.append(times[0])
        others.append(sum(times[1:]))
        # Let a grace period pass, as between two launches.
        time.sleep(0.05)

    def show(xs):
        ms = [x * 1000 for x in xs]
        return f"{statistics.median(ms):.2f} ({min(ms):.2f}, {max(ms):.2f})"

    print(
        f"{args.rounds} rounds, {len(dirs)} dirs, joined by {args.file}: "
        f"mkdir {show(made)} | first join {show(first)} | "
        f"other joins {show(others)} | rmdir {show(removed)}"
    )


if __name__ == "__main__":
    main()
