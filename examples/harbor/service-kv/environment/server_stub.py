"""An incomplete HTTP server: finish it (or write your own) and keep it running."""

from http.server import BaseHTTPRequestHandler, HTTPServer

HOST, PORT = "127.0.0.1", 8765


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        # TODO: answer /health with "ok" and /sum?a=..&b=.. with the sum
        self.send_response(501)
        self.end_headers()


if __name__ == "__main__":
    # TODO: serve forever on HOST:PORT
    pass
