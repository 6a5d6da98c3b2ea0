"""The driver's heartbeat endpoint: workers POST JSON heartbeats; the operator may GET the latest.

  POST /heartbeat   body: an events.Heartbeat as JSON (at most 64 KiB)
  GET  /status      {rank: latest heartbeat, with 'received' (driver clock) added}

Both need the job's secret token, `Authorization: Bearer <token>` (the driver makes one per
job and hands it to its workers as MSCALE_HEARTBEAT_TOKEN; the local driver also leaves it in
WORKDIR/resilience/heartbeat_token, readable by its owner only):

  curl -H "Authorization: Bearer $(cat WORKDIR/resilience/heartbeat_token)" \
      http://HOST:PORT/status

Whatever arrives is checked before the driver sees it: a missing or wrong token (401), a body
over 64 KiB or without a length (413, 411), anything but a well-typed heartbeat of a rank of
the running group (400) is turned away with a log line, and nothing a client sends can raise
into the driver. Plain HTTP/JSON (stdlib `http.server`): it works across hosts and with curl.
"""
import collections
import dataclasses
import hmac
import http.server
import json
import math
import os
import threading
import time
import types
import typing

from mscale_jax.observability.straggler import HOST_METRICS
from mscale_jax.resilience import events

MAX_BODY_BYTES = events.MAX_HEARTBEAT_BYTES
MAX_COUNT = 2**53          # steps, attempts, slots, pids: beyond this a number is not one
LOGGED_PER_REASON = 5      # rejections printed per reason; the rest are only counted
# events.Heartbeat's fields and their types, resolved once (not per request).
_HINTS = typing.get_type_hints(events.Heartbeat)
_FIELDS = [(f.name, _HINTS[f.name]) for f in dataclasses.fields(events.Heartbeat)]


class Rejected(ValueError):
  """A request the server turns away: HTTP `status`, and why (for the client and the log)."""

  def __init__(self, status: int, reason: str, key: str | None = None):
    super().__init__(reason)
    self.status, self.reason = status, reason
    self.key = f"{status} {key or reason}"   # what rejections are counted by


def parse_heartbeat(body: bytes, num_ranks: int | None) -> events.Heartbeat:
  """The heartbeat `body` holds, checked field by field; `Rejected` (400) naming what is wrong.

  Every field must have its declared type (events.Heartbeat's annotations, so a field added
  there is checked too); counts must be in range, the rank one of the running group's
  (`num_ranks`; None: any), the phase and a reported failure's kind known ones, and the
  observability fields shaped as the observer reads them. Unknown fields are ignored.
  """
  try:
    obj = json.loads(body)
  except (ValueError, RecursionError) as e:   # RecursionError: absurdly nested JSON
    raise Rejected(400, f"not JSON ({type(e).__name__})", "not JSON") from None
  if not isinstance(obj, dict):
    raise Rejected(400, f"a heartbeat is a JSON object, not {type(obj).__name__}",
                   "not an object")
  for field in ("rank", "host", "pid"):
    if field not in obj:
      raise Rejected(400, f"no '{field}'", field)
  for name, annotation in _FIELDS:
    if name in obj and not _conforms(obj[name], annotation):
      raise Rejected(400, f"'{name}' is not {_name(annotation)}: {_show(obj[name])}", name)
  _check_ranges(obj, num_ranks)
  return events.Heartbeat.from_json(obj)


def _check_ranges(obj: dict, num_ranks: int | None) -> None:
  def bad(field, what):
    raise Rejected(400, f"'{field}' must be {what}: {_show(obj[field])}", field)
  if not 0 <= obj["rank"] < (num_ranks or MAX_COUNT):
    bad("rank", f"a rank of the running group (0..{num_ranks - 1})" if num_ranks else ">= 0")
  for field in ("pid", "attempt", "slot", "step", "nonfinite_steps"):
    if field in obj and not 0 <= obj[field] < MAX_COUNT:
      bad(field, "in [0, 2**53)")
  for field in ("step_time_s", "data_wait_s", "step_age_s", "time"):
    if obj.get(field) is not None and not (math.isfinite(obj[field]) and obj[field] >= 0):
      bad(field, "a finite number >= 0")
  if obj.get("phase", events.STARTING) not in events.PHASES:
    bad("phase", f"one of {events.PHASES}")
  if obj.get("failure") is not None:
    failure = obj["failure"]
    if failure.get("kind") not in events.FAILURE_KINDS or \
        not isinstance(failure.get("detail"), str) or \
        not _conforms(failure.get("step"), int | None) or \
        not 0 <= (failure.get("step") or 0) < MAX_COUNT or \
        not _conforms(failure.get("rank"), int | None) or \
        not 0 <= (failure.get("rank") or 0) < (num_ranks or MAX_COUNT):
      bad("failure", f"{{'kind': one of {events.FAILURE_KINDS}, 'detail': str, "
                     f"'step': int >= 0 or null, 'rank': a rank of the group or null}}")
  for item in obj.get("recovered") or ():
    if not (item.get("kind") in events.RECOVERED_KINDS and isinstance(item.get("detail"), str)
            and _conforms(item.get("step"), int | None) and _conforms(item.get("seq"), int)
            and 0 <= (item.get("step") or 0) < MAX_COUNT and 0 < item["seq"] < MAX_COUNT
            and _conforms(item.get("time"), float) and math.isfinite(item["time"])):
      bad("recovered", f"[{{'kind': one of {events.RECOVERED_KINDS}, 'detail': str, "
                       f"'step': int >= 0 or null, 'time': number, 'seq': int > 0}}, ...]")
  for item in obj.get("step_phases") or ():
    if not (isinstance(item, list) and len(item) == 2 and _conforms(item[0], int)
            and 0 <= item[0] < MAX_COUNT and _conforms(item[1], dict[str, float])
            and all(math.isfinite(s) and s >= 0 for s in item[1].values())):
      bad("step_phases", "[[step, {phase: seconds >= 0}], ...]")
  where = obj.get("where")
  if where is not None and not (len(where) == 3 and _conforms(where[0], str | None)
                                and _conforms(where[1], int | None)
                                and _conforms(where[2], float | None)):
    bad("where", "[phase, step or null, seconds or null]")
  metrics = obj.get("host_metrics")
  if metrics is not None and not (all(k in metrics for k in HOST_METRICS)
                                  and all(math.isfinite(v) for v in metrics.values())):
    bad("host_metrics", f"finite numbers, with {HOST_METRICS}")


def _conforms(value, annotation) -> bool:
  """Whether JSON-decoded `value` has type `annotation` (int, float, str, bool, None, Any,
  unions, list[...] and dict[str, ...]); a float field takes an int up to 2**53, no number
  field a bool."""
  origin, args = typing.get_origin(annotation), typing.get_args(annotation)
  if annotation is typing.Any:
    return True
  if annotation is None or annotation is type(None):
    return value is None
  if origin in (typing.Union, types.UnionType):
    return any(_conforms(value, a) for a in args)
  if annotation is float:   # an int too, if a float holds it exactly
    return isinstance(value, float) or _conforms(value, int) and abs(value) <= MAX_COUNT
  if annotation is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if origin is list or annotation is list:
    return isinstance(value, list) and all(_conforms(v, args[0]) for v in value if args)
  if origin is dict or annotation is dict:
    return isinstance(value, dict) and all(
        isinstance(k, str) and (not args or _conforms(v, args[1])) for k, v in value.items())
  return isinstance(value, annotation) if isinstance(annotation, type) else True


def _name(annotation) -> str:
  return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _show(value) -> str:
  text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) \
      else str(value)
  return text if len(text) <= 60 else text[:57] + "..."


def save_token(token: str, path: str) -> None:
  """Writes the job's token to `path`, readable by its owner only (for `curl .../status`)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  if os.path.exists(path):
    os.unlink(path)
  with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
    f.write(token + "\n")


class HeartbeatServer:
  """A threaded HTTP server holding each rank's latest (checked) heartbeat and its arrival.

  Args:
    host, port: where to listen (port 0: any free one; `url` says which).
    token: the job's secret; requests without it are refused (None: no check, for tests).
    say: where rejections are logged (the driver's print), a few per reason; all are counted
      in `rejections`.
  """

  def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
               say=None):
    self._lock = threading.Lock()
    self._latest: dict[int, tuple[events.Heartbeat, float]] = {}
    self.listeners = []   # called with (heartbeat, arrival time) for every heartbeat
    self.num_ranks: int | None = None   # ranks of the running group (the driver sets it)
    self.rejections: collections.Counter = collections.Counter()
    self._token = token
    self._say = say or (lambda message: None)
    server = self

    class Handler(http.server.BaseHTTPRequestHandler):
      timeout = 10   # seconds a client may take to send its request (no slow-loris threads)

      def do_POST(self):
        self._answer(self._post)

      def do_GET(self):
        self._answer(self._get)

      def _answer(self, serve):
        try:
          serve()
        except Rejected as e:
          server._reject(self, e)
        except OSError:   # the client hung up or was too slow (Handler.timeout)
          server._count("connection error")
        except Exception as e:   # a bug of ours must not take the driver down either
          server._reject(self, Rejected(500, f"{type(e).__name__}: {e}", "server error"))

      def _post(self):
        if self.path != "/heartbeat":
          raise Rejected(404, f"no such endpoint {self.path[:60]!r}", "no such endpoint")
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
          raise Rejected(411, "a heartbeat needs a Content-Length")
        if int(length) > MAX_BODY_BYTES:
          raise Rejected(413, f"body of {int(length)} bytes (at most {MAX_BODY_BYTES})",
                         "body too large")
        body = self.rfile.read(int(length))   # read even if refused: the answer then arrives
        server._authorize(self.headers.get("Authorization", ""))
        server.receive(parse_heartbeat(body, server.num_ranks))
        self.send_response(204)
        self.end_headers()

      def _get(self):
        server._authorize(self.headers.get("Authorization", ""))
        if self.path != "/status":
          raise Rejected(404, f"no such endpoint {self.path[:60]!r}", "no such endpoint")
        body = json.dumps({rank: {**b.to_json(), "received": t}
                           for rank, (b, t) in server.latest().items()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

      def log_message(self, *args):
        pass

    class Server(http.server.ThreadingHTTPServer):
      daemon_threads = True
      request_queue_size = 256   # a flood must not crowd out the workers' connections

      def handle_error(self, request, client_address):
        server._count("connection error")   # e.g. a client that hung up mid-request

    self._http = Server((host, port), Handler)
    self.url = f"http://{host}:{self._http.server_address[1]}/heartbeat"
    self._thread = threading.Thread(target=self._http.serve_forever, name="heartbeats",
                                    daemon=True)
    self._thread.start()

  def _authorize(self, header: str) -> None:
    if self._token is None:
      return
    scheme, _, given = header.partition(" ")
    if scheme != "Bearer" or not hmac.compare_digest(given.strip().encode(),
                                                     self._token.encode()):
      raise Rejected(401, "missing or wrong token", "token")

  def _reject(self, handler, rejected: Rejected) -> None:
    self._count(rejected.key, f"{handler.client_address[0]}: {rejected.status} "
                              f"{rejected.reason}")
    try:
      reason = rejected.reason.encode("ascii", "replace").decode()   # it goes in a header
      handler.send_error(rejected.status, reason.splitlines()[0][:200])
    except OSError:
      pass

  def _count(self, key: str, message: str | None = None) -> None:
    with self._lock:
      self.rejections[key] += 1
      count = self.rejections[key]
    if message is not None and count <= LOGGED_PER_REASON:
      more = " (further ones like it are only counted)" if count == LOGGED_PER_REASON else ""
      self._say(f"heartbeat endpoint: rejected a request from {message}{more}")

  def receive(self, beat: events.Heartbeat) -> None:
    """Stores an accepted heartbeat as its rank's latest and hands it to every listener.

    A worker's periodic heartbeat and the one it sends at once (a failure, just before it
    exits) travel on separate connections and may arrive out of order: a heartbeat the same
    process stamped earlier than the one held never replaces it (else a stale one would erase
    the failure the worker reported). Listeners still get it (its step phases are new).
    """
    received = time.time()
    with self._lock:
      held = self._latest.get(beat.rank)
      if held is None or (held[0].pid, held[0].attempt) != (beat.pid, beat.attempt) or \
          beat.time >= held[0].time:
        self._latest[beat.rank] = (beat, received)
    for listener in self.listeners:
      listener(beat, received)

  def latest(self) -> dict[int, tuple[events.Heartbeat, float]]:
    """{rank: (latest heartbeat, driver time it arrived)}."""
    with self._lock:
      return dict(self._latest)

  def clear(self, num_ranks: int | None = None) -> None:
    """Forgets every heartbeat (before a restarted group of `num_ranks` ranks reports)."""
    with self._lock:
      self._latest.clear()
      self.num_ranks = num_ranks

  def close(self) -> None:
    self._http.shutdown()
    self._http.server_close()
