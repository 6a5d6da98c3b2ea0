"""The driver's heartbeat endpoint: workers POST JSON heartbeats; anyone may GET the latest.

  POST /heartbeat   body: an events.Heartbeat as JSON
  GET  /status      {rank: latest heartbeat, with 'received' (driver clock) added}

Plain HTTP/JSON (stdlib `http.server`), so it works across hosts, through proxies and with curl.
"""
import http.server
import json
import threading
import time

from mscale_jax.resilience.events import Heartbeat


class HeartbeatServer:
  """A threaded HTTP server holding each rank's latest heartbeat (and when it arrived)."""

  def __init__(self, host: str = "127.0.0.1", port: int = 0):
    self._lock = threading.Lock()
    self._latest: dict[int, tuple[Heartbeat, float]] = {}
    self.listeners = []   # called with (heartbeat, arrival time) for every heartbeat
    server = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_POST(self):
        try:
          length = int(self.headers.get("Content-Length", 0))
          beat = Heartbeat.from_json(json.loads(self.rfile.read(length)))
        except (ValueError, TypeError):
          self.send_error(400, "expected a heartbeat as JSON")
          return
        server.receive(beat)
        self.send_response(204)
        self.end_headers()

      def do_GET(self):
        body = json.dumps({rank: {**b.to_json(), "received": t}
                           for rank, (b, t) in server.latest().items()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

      def log_message(self, *args):
        pass

    self._http = http.server.ThreadingHTTPServer((host, port), Handler)
    self._http.daemon_threads = True
    self.url = f"http://{host}:{self._http.server_address[1]}/heartbeat"
    self._thread = threading.Thread(target=self._http.serve_forever, name="heartbeats",
                                    daemon=True)
    self._thread.start()

  def receive(self, beat: Heartbeat) -> None:
    received = time.time()
    with self._lock:
      self._latest[beat.rank] = (beat, received)
    for listener in self.listeners:
      listener(beat, received)

  def latest(self) -> dict[int, tuple[Heartbeat, float]]:
    """{rank: (latest heartbeat, driver time it arrived)}."""
    with self._lock:
      return dict(self._latest)

  def clear(self) -> None:
    """Forgets every heartbeat (before a restarted group reports)."""
    with self._lock:
      self._latest.clear()

  def close(self) -> None:
    self._http.shutdown()
    self._http.server_close()
