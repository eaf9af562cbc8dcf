# The hostile program of the isolation tests: an HTTP server that, asked
# by the test (through berth's proxy), tries to cross a boundary from
# inside its instance and reports what happened. Python's standard library
# only; run as `python3 -c <this> <port>`.
#
# Every answer is JSON. A probe that fails reports the errno's name.
import ctypes
import errno
import json
import os
import pwd
import socket
import ssl
import struct
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = int(sys.argv[1])
HOLD = []


def outcome(f):
    try:
        return {"ok": True, "value": f()}
    except OSError as e:
        return {"ok": False, "errno": errno.errorcode.get(e.errno, str(e.errno))}
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"ok": False, "errno": type(e).__name__}


def read(path):
    with open(path, "rb") as f:
        return len(f.read())


def write(path):
    with open(path, "w") as f:
        f.write("breach")
    return True


def connect(host, port):
    with socket.create_connection((host, int(port)), timeout=5):
        return True


def fetch(host, port, name, tls):
    """Connects to host:port and asks for `name`: a TLS ClientHello whose
    SNI is `name` (tls == "1"), else an HTTP request whose Host is `name`.
    The test's hosts answer `HTTP/1.0 200` on every connection, so what
    comes back says whether the request reached one; an egress proxy that
    refuses it closes the connection with nothing."""
    with socket.create_connection((host, int(port)), timeout=5) as s:
        if tls == "1":
            incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
            hello = ssl.create_default_context().wrap_bio(
                incoming, outgoing, server_hostname=name
            )
            try:
                hello.do_handshake()
            except ssl.SSLWantReadError:
                pass
            s.sendall(outgoing.read())
        else:
            s.sendall(("GET / HTTP/1.0\r\nHost: %s\r\n\r\n" % name).encode())
        answer = s.recv(64)
        if not answer.startswith(b"HTTP/1.0 200"):
            raise ConnectionAbortedError(errno.ECONNABORTED, "no answer from the host")
        return True


def relayed(target, name):
    """Asks the sandbox's relay (the HTTPS_PROXY berth gives the program)
    for a tunnel to `target` (host:port), then asks for `name` through it
    as `fetch` does over HTTP. A tunnel refused reports the relay's
    status; a request refused behind it, ECONNABORTED."""
    proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
    with socket.create_connection((proxy.hostname, proxy.port), timeout=20) as s:
        s.sendall(("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)).encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
        status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/1.1 ") else "none"
        if status != "200":
            return {"ok": False, "status": status}
        # The test's hosts answer at once: their answer may have come
        # with the relay's.
        answer = head.split(b"\r\n\r\n", 1)[1]
        s.sendall(("GET / HTTP/1.0\r\nHost: %s\r\n\r\n" % name).encode())
        if len(answer) < 12:
            answer += s.recv(64)
        if not answer.startswith(b"HTTP/1.0 200"):
            return {"ok": False, "errno": "ECONNABORTED"}
        return {"ok": True, "status": status}


def lookup(server, name):
    """Sends a DNS query for `name` (type A) to server:53 over UDP and
    returns the answer's response code (0: answered, 5: refused)."""
    query = struct.pack(">HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        query += bytes([len(label)]) + label.encode()
    query += b"\x00\x00\x01\x00\x01"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(3)
        s.sendto(query, (server, 53))
        answer, _ = s.recvfrom(4096)
    return answer[3] & 0x0F


def status_fields():
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def whoami():
    fields = status_fields()
    try:
        name = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        name = None
    return {
        "uid": os.getuid(),
        "euid": os.geteuid(),
        "gid": os.getgid(),
        "groups": os.getgroups(),
        "passwd_name": name,
        "env": {k: os.environ.get(k) for k in ("HOME", "USER", "LOGNAME", "TMPDIR")},
        "status": {k: fields.get(k) for k in (
            "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")},
        "cwd": os.getcwd(),
        "pid": os.getpid(),
    }


def processes():
    seen = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid = os.stat(f"/proc/{entry}").st_uid
            except OSError:
                continue
            seen.append([int(entry), uid])
    return sorted(seen)


def environ_scan(needles):
    readable, leaks = 0, []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                data = f.read()
        except OSError:
            continue
        readable += 1
        if any(n.encode() in data for n in needles):
            leaks.append(int(entry))
    return {"readable": readable, "leaks": leaks}


def shim_command(path, command):
    # Connect to a shim's control socket, send a command, and report
    # whether the shim greeted us (it greets only berth).
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    s.sendall(json.dumps(command).encode() + b"\n")
    try:
        greeting = s.recv(65536)
    except socket.timeout:
        greeting = b""
    s.close()
    return {"greeted": len(greeting) > 0}


def replace_with_link(name, target):
    root = os.path.dirname(os.environ["HOME"])
    path = os.path.join(root, name)
    for entry in os.listdir(path):
        os.unlink(os.path.join(path, entry))
    os.rmdir(path)
    os.symlink(target, path)
    return True


def link_file(path, target):
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(target, path)
    return True


def allocate(mb):
    block = bytearray(mb * 1024 * 1024)
    for i in range(0, len(block), 4096):
        block[i] = 1
    HOLD.append(block)
    return mb


def fork_bomb():
    def bomb():
        while True:
            try:
                os.fork()
            except OSError:
                time.sleep(0.01)
    threading.Thread(target=bomb, daemon=True).start()
    return True


def spew(mb):
    # Prints `mb` MiB of numbered lines as fast as it can, then "spew
    # done", from a thread (the answer comes at once).
    def run():
        line = "x" * 90
        out = sys.stdout.buffer
        for i in range(mb * 1024 * 1024 // 100):
            out.write(b"spew %08d %s\n" % (i, line.encode()))
        out.write(b"spew done\n")
        out.flush()
    threading.Thread(target=run, daemon=True).start()
    return True


def unlink(path):
    os.unlink(path)
    return True


def bind_many(first, last):
    # Listens on every port of [first, last] it can, and keeps them.
    held = 0
    for port in range(int(first), int(last) + 1):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            s.close()
            continue
        HOLD.append(s)
        held += 1
    return held


def connect_many(port, sources, each):
    # Opens `each` connections to 127.0.0.1:`port` from each of `sources`
    # source addresses 127.0.1.1, 127.0.1.2, …, and keeps them open.
    opened, refused = 0, 0
    for n in range(int(sources)):
        for _ in range(int(each)):
            s = socket.socket()
            s.settimeout(5)
            try:
                s.bind((f"127.0.1.{n + 1}", 0))
                s.connect(("127.0.0.1", int(port)))
            except OSError:
                s.close()
                refused += 1
                continue
            HOLD.append(s)
            opened += 1
    return {"opened": opened, "refused": refused}


def forge_log():
    # Text that would read as a line of berth's own log, with terminal
    # control codes, then a crash: berth copies the tail of stderr into
    # its log as the crash's description.
    sys.stderr.write("\n2030-01-01T00:00:00.000000Z  INFO berth::serve: FORGED admin "
                     "token is 1234\x1b[31m red \x1b]0;title\x07\n")
    sys.stderr.flush()
    os._exit(3)


def signal_process(pid, sig):
    os.kill(int(pid), int(sig))
    return True


PTRACE_ATTACH, PTRACE_DETACH = 16, 17


def trace(pid):
    """Attaches to `pid` as a debugger would, then lets it go: whoever may
    do this may read and write the process's memory and registers."""
    pid = int(pid)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    if libc.ptrace(PTRACE_ATTACH, pid, None, None) == -1:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    os.waitpid(pid, 0x40000000)  # __WALL: the attach's stop
    libc.ptrace(PTRACE_DETACH, pid, None, None)
    return True


def trace_own_child():
    """`trace` of a child of the program's own: what the kernel allows
    a program, so a refusal elsewhere is not a broken probe."""
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    try:
        return trace(pid)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def kill_everything():
    """kill(-1, SIGKILL): every process the program may signal, but
    itself and init."""
    os.kill(-1, 9)
    return True


def spin(n):
    """`n` processes that spin on the CPU until killed."""
    pids = []
    for _ in range(int(n)):
        pid = os.fork()
        if pid == 0:
            while True:
                pass
        pids.append(pid)
    return pids


def listen6(port):
    """A TCP listener on [::1]:port, kept open."""
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::1", int(port)))
    s.listen(8)
    HOLD.append(s)
    return True


class Thief(BaseHTTPRequestHandler):
    """Answers on a port stolen from another instance, and counts what it
    was sent (in $HOME/stolen)."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        with open(os.path.join(os.environ["HOME"], "stolen"), "a") as f:
            f.write(self.path + "\n")
        body = json.dumps({"ok": True, "stolen": True, "uid": os.getuid()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def steal(port):
    server = ThreadingHTTPServer(("127.0.0.1", int(port)), Thief)
    HOLD.append(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return True


def stolen():
    try:
        with open(os.path.join(os.environ["HOME"], "stolen")) as f:
            return len(f.read().splitlines())
    except FileNotFoundError:
        return 0


def listen(port, name):
    """A TCP listener on 127.0.0.1:port and one on the abstract unix
    socket @name, kept open: services a program might run beside its
    own port."""
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("127.0.0.1", int(port)))
    tcp.listen(8)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind("\0" + name)
    unix.listen(8)
    HOLD.extend([tcp, unix])
    return True


def unix_connect(name):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect("\0" + name)
    return True


def mentions(path, needle):
    """Whether the file at path mentions needle (a /proc/net table, say)."""
    with open(path) as f:
        return needle in f.read()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(url.query)
        one = lambda k: q.get(k, [""])[0]  # noqa: E731
        probe = url.path.rstrip("/").rsplit("/", 1)[-1]
        if probe == "ping":
            result = {"ok": True}
        elif probe == "whoami":
            result = whoami()
        elif probe == "read":
            result = outcome(lambda: read(one("path")))
        elif probe == "list":
            result = outcome(lambda: len(os.listdir(one("path"))))
        elif probe == "write":
            result = outcome(lambda: write(one("path")))
        elif probe == "connect":
            result = outcome(lambda: connect(one("host"), one("port")))
        elif probe == "fetch":
            result = outcome(lambda: fetch(one("host"), one("port"), one("name"), one("tls")))
        elif probe == "relayed":
            try:
                result = relayed(one("target"), one("name"))
            except OSError as e:
                result = {"ok": False, "errno": errno.errorcode.get(e.errno, str(e.errno))}
        elif probe == "lookup":
            result = outcome(lambda: lookup(one("server"), one("name")))
        elif probe == "listen":
            result = outcome(lambda: listen(one("port"), one("name")))
        elif probe == "uconnect":
            result = outcome(lambda: unix_connect(one("name")))
        elif probe == "mentions":
            result = outcome(lambda: mentions(one("path"), one("needle")))
        elif probe == "processes":
            result = processes()
        elif probe == "environ":
            result = environ_scan(q.get("needle", []))
        elif probe == "shim":
            command = json.loads(one("command"))
            result = outcome(lambda: shim_command(one("path"), command))
        elif probe == "link":
            result = outcome(lambda: replace_with_link(one("name"), one("target")))
        elif probe == "filelink":
            result = outcome(lambda: link_file(one("path"), one("target")))
        elif probe == "alloc":
            result = outcome(lambda: allocate(int(one("mb"))))
        elif probe == "spew":
            result = spew(int(one("mb")))
        elif probe == "unlink":
            result = outcome(lambda: unlink(one("path")))
        elif probe == "bindmany":
            result = outcome(lambda: bind_many(one("first"), one("last")))
        elif probe == "connectmany":
            result = outcome(lambda: connect_many(one("port"), one("sources"), one("each")))
        elif probe == "signal":
            result = outcome(lambda: signal_process(one("pid"), one("sig")))
        elif probe == "trace":
            result = outcome(lambda: trace(one("pid")))
        elif probe == "traceown":
            result = outcome(trace_own_child)
        elif probe == "killall":
            result = outcome(kill_everything)
        elif probe == "spin":
            result = outcome(lambda: spin(one("n")))
        elif probe == "listen6":
            result = outcome(lambda: listen6(one("port")))
        elif probe == "forkbomb":
            result = fork_bomb()
        elif probe == "forge":
            forge_log()
            return
        elif probe == "steal":
            result = outcome(lambda: steal(one("port")))
        elif probe == "stolen":
            result = {"ok": True, "value": stolen()}
        else:
            self.send_response(404)
            self.end_headers()
            return
        body = json.dumps(result).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
