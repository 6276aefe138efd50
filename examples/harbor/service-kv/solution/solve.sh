#!/bin/bash
set -euo pipefail
cat > /app/server.py <<'PY'
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

HOST, PORT = "127.0.0.1", 8765


class Handler(BaseHTTPRequestHandler):
    def reply(self, status, body):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        url = urlparse(self.path)
        if url.path == "/health":
            return self.reply(200, "ok")
        if url.path == "/sum":
            q = parse_qs(url.query)
            try:
                return self.reply(200, str(int(q["a"][0]) + int(q["b"][0])))
            except (KeyError, ValueError):
                return self.reply(400, "bad request")
        return self.reply(404, "not found")

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer((HOST, PORT), Handler).serve_forever()
PY
nohup python3 /app/server.py >/tmp/server.log 2>&1 &
for _ in $(seq 1 50); do
  if python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:8765/health", timeout=1)' 2>/dev/null; then
    exit 0
  fi
  sleep 0.2
done
echo "server did not come up" >&2
cat /tmp/server.log >&2
exit 1
