"""The service the agent left running must answer on 127.0.0.1:8765."""

import time
import urllib.error
import urllib.request

BASE = "http://127.0.0.1:8765"


def get(path: str, wait_s: float = 5.0) -> tuple[int, str]:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(BASE + path, timeout=3) as resp:
                return resp.status, resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace")
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_health():
    status, body = get("/health")
    assert status == 200
    assert body.strip() == "ok"


def test_sum_example():
    status, body = get("/sum?a=2&b=3")
    assert status == 200
    assert body.strip() == "5"


def test_sum_negative():
    status, body = get("/sum?a=-4&b=10")
    assert status == 200
    assert body.strip() == "6"


def test_sum_larger():
    status, body = get("/sum?a=40&b=2")
    assert status == 200
    assert body.strip() == "42"
