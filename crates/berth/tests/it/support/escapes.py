# Three ways out of a program's process group, each writing a line to a
# journal every 10 ms: "<epoch> <kind> <n>". A process that is really
# frozen or killed writes nothing; one that escaped keeps writing.
#
#   setsid  a child in a session of its own
#   double  a double fork with a setsid between (reparented, like a daemon)
#   racer   a new process for every line: it writes, forks its successor
#           and exits, so a freeze or kill must catch a fork in flight
#
# Usage: python3 escapes.py [JOURNAL]  (default: $HOME/escapes.log)
import os
import sys
import time

journal = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ["HOME"], "escapes.log")
epoch = os.environ.get("BERTH_EPOCH", "0")


def line(fd, kind, n):
    os.write(fd, ("%s %s %d\n" % (epoch, kind, n)).encode())


def open_journal():
    return os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def forever(kind):
    fd = open_journal()
    n = 0
    while True:
        n += 1
        line(fd, kind, n)
        time.sleep(0.01)


if os.fork() == 0:
    os.setsid()
    forever("setsid")

if os.fork() == 0:
    if os.fork():
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    forever("double")

if os.fork() == 0:
    os.setsid()
    fd = open_journal()
    n = 0
    while True:
        n += 1
        line(fd, "racer", n)
        time.sleep(0.01)
        if os.fork():
            os._exit(0)

os._exit(0)
