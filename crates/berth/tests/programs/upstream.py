#!/usr/bin/env python3
"""A small HTTP/1.1 program for berth's end-to-end proxy tests
(crates/berth/tests/proxy_e2e.rs), for the parts `berth demo-app` cannot
play. berth runs it as a user's instance:

    upstream.py PORT                  serve on 127.0.0.1:PORT
    upstream.py PORT --refuse         print the ready line, never listen
    upstream.py PORT --listen-late MS print the ready line, listen MS later

Every response carries a body and its Content-Length, so connections stay
open (keep-alive) unless the client asks otherwise. Request bodies are read
by their Content-Length or, when chunked, chunk by chunk.

* GET/POST .../echo: the request line and headers as JSON, answered with
  hop-by-hop headers of its own (Connection naming X-Up-Secret,
  X-Up-Secret, Keep-Alive, Proxy-Authenticate) next to X-App: yes.
* GET/POST .../flaky: answered, after which this connection drops the
  next request it reads without answering, as a server whose keep-alive
  timeout fires at that moment does. Each drop is logged on stdout
  ("upstream: dropped <METHOD>"), which berth writes to the user's log.
* GET .../say?h=NAME:VALUE&h=…&type=TYPE&body=TEXT: answered with exactly
  those headers, content type and body, as a hostile program would answer
  (the security tests' attacks).
* any method .../poke: counted, by method ("upgrade" for a handshake
  asking to upgrade), and reported by GET .../pokes as
  {"POST": n, "upgrade": n, …}: whether a browser's request got through.
* GET .../print?text=TEXT: TEXT is written to stdout (the user's log) as
  it is, control characters included.
* GET .../leak: gives away this program's launch token (printed in its
  ready line, `token=…`) every way a response can: in a Location, a
  Set-Cookie and a header of its own, and in a chunked body that splits it
  across chunks. A hostile or careless program's answer.
"""

import http.server
import json
import secrets
import signal
import socketserver
import sys
import threading
import time
import urllib.parse

POKES = {}
# The launch token this run prints in its ready line.
TOKEN = secrets.token_hex(24)
POKES_LOCK = threading.Lock()


def log(line):
    print(f"upstream: {line}", flush=True)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, body, extra=()):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def read_body(self):
        # A chunked body (berth forwards one when the client sent one) is
        # read whole, so its bytes can never pass for a next request here.
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return body
                body += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def handle_any(self):
        if getattr(self, "drop_next", False):
            # Read nothing more and answer nothing: the connection closes.
            log(f"dropped {self.command}")
            self.close_connection = True
            return
        body = self.read_body()
        seen = {
            "method": self.command,
            "path": self.path,
            "headers": [[k.lower(), v] for k, v in self.headers.items()],
            "body_bytes": len(body),
            # Whether the request presented this program's launch token, as
            # a program that guards itself with it checks.
            "token_presented": self.headers.get_all("Authorization", [])
            == [f"token {TOKEN}"],
        }
        route = self.path.split("?")[0]
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        if route.endswith("/say"):
            self.say(query)
        elif route.endswith("/poke"):
            kind = "upgrade" if self.headers.get("Upgrade") else self.command
            with POKES_LOCK:
                POKES[kind] = POKES.get(kind, 0) + 1
            self.answer({"poked": kind})
        elif route.endswith("/pokes"):
            with POKES_LOCK:
                self.answer(dict(POKES))
        elif route.endswith("/print"):
            sys.stdout.write(query.get("text", [""])[0] + "\n")
            sys.stdout.flush()
            self.answer({"printed": True})
        elif route.endswith("/leak"):
            self.leak()
        elif route.endswith("/flaky"):
            self.drop_next = True
            self.answer(seen)
        elif self.path.split("?")[0].endswith("/echo"):
            self.answer(
                seen,
                [
                    ("Connection", "X-Up-Secret"),
                    ("X-Up-Secret", "1"),
                    ("Keep-Alive", "timeout=5"),
                    ("Proxy-Authenticate", 'Basic realm="upstream"'),
                    ("X-App", "yes"),
                ],
            )
        else:
            self.answer(seen)

    def leak(self):
        self.send_response(302)
        self.send_header("Location", f"/lab?token={TOKEN}")
        self.send_header("Set-Cookie", f"app_token={TOKEN}; Path=/")
        self.send_header("X-Token", TOKEN)
        self.send_header("Content-Type", "text/html")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        half = len(TOKEN) // 2
        for piece in [f'<a href="?token={TOKEN[:half]}', f'{TOKEN[half:]}">lab</a> ', TOKEN, "."]:
            data = piece.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def say(self, query):
        data = query.get("body", [""])[0].encode()
        self.send_response(200)
        self.send_header("Content-Type", query.get("type", ["text/plain"])[0])
        self.send_header("Content-Length", str(len(data)))
        for header in query.get("h", []):
            name, _, value = header.partition(":")
            self.send_header(name.strip(), value.strip())
        self.end_headers()
        self.wfile.write(data)

    do_GET = handle_any
    do_POST = handle_any
    do_PUT = handle_any
    do_DELETE = handle_any


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main():
    port = int(sys.argv[1])
    if "--refuse" in sys.argv[2:]:
        log(f"listening on {port}")
        while True:
            signal.pause()
    args = sys.argv[2:]
    if "--listen-late" in args:
        # The ready line comes first, as with programs that announce their
        # URL a moment before they bind (Jupyter Server does).
        late_ms = int(args[args.index("--listen-late") + 1])
        log(f"listening on {port}")
        time.sleep(late_ms / 1000)
        server = Server(("127.0.0.1", port), Handler)
        log("bound at last")
    else:
        server = Server(("127.0.0.1", port), Handler)
        log(f"listening on {port} token={TOKEN}")
    server.serve_forever()


if __name__ == "__main__":
    main()
