"""Hostile input at the driver's heartbeat endpoint: a token, size and type checks, and a fuzz
run against a live driver supervising a real 2-process job (which must not notice)."""
import http.client
import json
import logging
import random
import socket
import threading
import time
import urllib.parse

import pytest

from experiments import job
from mscale_jax.resilience import events
from mscale_jax.resilience.driver.server import MAX_BODY_BYTES, HeartbeatServer
from mscale_jax.resilience.driver.supervisor import free_port
from mscale_jax.resilience.worker.heartbeat import HeartbeatClient

TOKEN = "s3cret-" + "x" * 20


def request(url, method="POST", body=b"", token=TOKEN, path=None, headers=None):
  """One HTTP request; returns the status code, or 'reset' if the server hung up first."""
  parts = urllib.parse.urlsplit(url)
  connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=20)
  all_headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
  all_headers.update(headers or {})
  try:
    connection.request(method, path or parts.path, body=body, headers=all_headers)
    return connection.getresponse().status
  except (ConnectionResetError, BrokenPipeError):
    return "reset"
  finally:
    connection.close()


def good_beat(rank=0, **fields) -> dict:
  beat = events.Heartbeat(rank=rank, host="h", pid=1, phase=events.TRAINING, step=3, loss=2.0,
                          step_time_s=0.1, step_phases=[[3, {"host": 0.01}]],
                          where=["sync", 3, 0.2], host_metrics={"probe_ms": 1.0, "rss_mb": 9.0})
  return {**beat.to_json(), **fields}


# A field of an otherwise good heartbeat, set to a wrong type or out of range.
WRONG_TYPES = [("rank", "0"), ("rank", 1.5), ("rank", True), ("rank", None), ("pid", "1"),
               ("step", [1]), ("step", 2.0), ("phase", 7), ("phase", "napping"),
               ("failure", "notadict"), ("failure", {"kind": "meteor", "detail": "x"}),
               ("failure", {"kind": "exception"}), ("failure", {"kind": "hang", "detail": 3}),
               ("failure", {"kind": "exception", "detail": "x", "step": "9"}),
               ("loss", "low"), ("log_tail", "one line"), ("log_tail", [1, 2]),
               ("step_time_s", -1.0), ("step_time_s", float("inf")),
               ("step_time_s", float("nan")), ("time", float("inf")),
               ("step_phases", [[1, {"host": "fast"}]]), ("step_phases", [[1]]),
               ("step_phases", "all"), ("step_phases", [["1", {}]]),
               ("step_phases", [[1, {"host": -2.0}]]), ("where", ["sync"]),
               ("where", [1, 2, 3]), ("host_metrics", {"probe_ms": 1.0}),
               ("host_metrics", {"probe_ms": "x", "rss_mb": 1.0}), ("attempt", -1),
               ("step", 10**30), ("slot", 2**64), ("nonfinite_steps", -5),
               ("recovered", "one"), ("recovered", [{"kind": "meteor", "detail": "x",
                                                     "step": 4, "time": 1.0, "seq": 1}]),
               ("recovered", [{"kind": "save_refused", "detail": "x", "step": 4,
                               "time": 1.0, "seq": 0}]),
               ("step_time_s", 10**400), ("loss", -10**300), ("time", True),
               ("step_phases", [[1, {"host": 10**400}]]),
               ("host_metrics", {"probe_ms": 10**400, "rss_mb": 1.0})]


def hostile_payloads(rng: random.Random, num_ranks: int):
  """Yields (body, token, extra headers) of requests the endpoint must turn away: malformed
  bodies with the right token, and spoofed well-formed ones (a failure, 'done') without it."""
  kinds = ["truncated", "wrong type", "rank", "not an object", "garbage", "huge number",
           "nested", "too big", "spoofed", "no token", "missing field"]
  while True:
    kind = rng.choice(kinds)
    body, token, headers = None, TOKEN, None
    if kind == "truncated":
      text = json.dumps(good_beat(rng.randrange(num_ranks)))
      body = text[:rng.randrange(len(text))]
    elif kind == "wrong type":
      field, value = rng.choice(WRONG_TYPES)
      body = json.dumps({**good_beat(rng.randrange(num_ranks)), field: value})
    elif kind == "rank":
      body = json.dumps(good_beat(rng.choice([num_ranks, 99, -1, 2**63, -2**40])))
    elif kind == "not an object":
      body = rng.choice(["[]", "1", '"beat"', "null", "true", "[{}]"])
    elif kind == "garbage":
      body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
    elif kind == "huge number":
      body = '{"rank": ' + "9" * rng.randrange(4301, 20000) + ', "host": "h", "pid": 1}'
    elif kind == "nested":
      depth = rng.randrange(2000, 20000)
      body = '{"rank": 0, "host": "h", "pid": 1, "log_tail": ' + "[" * depth + "]" * depth + "}"
    elif kind == "too big":
      body = json.dumps(good_beat(0, log_tail=["x" * 1000] * (MAX_BODY_BYTES // 900)))
    elif kind == "spoofed":   # well formed: only the token is wrong
      body = json.dumps(good_beat(
          rng.randrange(num_ranks), phase=events.FAILED,
          failure=events.Failure(events.EXCEPTION, 0, "spoofed").to_json()))
      token = rng.choice(["", "wrong", TOKEN[:-1], TOKEN + "x", TOKEN.upper()])
    elif kind == "no token":
      body, token = json.dumps(good_beat(0, phase=events.DONE)), None
    elif kind == "missing field":
      beat = good_beat(0)
      del beat[rng.choice(["rank", "host", "pid"])]
      body = json.dumps(beat)
    yield kind, body.encode() if isinstance(body, str) else body, token, headers


def fuzz(url, count, seed, num_ranks, threads=8) -> dict:
  """Sends `count` hostile requests from `threads` threads (a flood); returns {status: count}
  and every (kind, status) that was not a 4xx."""
  generator = hostile_payloads(random.Random(seed), num_ranks)
  requests = [next(generator) for _ in range(count)]
  statuses, accepted, lock = {}, [], threading.Lock()

  def send(chunk):
    for kind, body, token, headers in chunk:
      status = request(url, body=body, token=token, headers=headers)
      with lock:
        statuses[status] = statuses.get(status, 0) + 1
        if status == "reset" and kind != "too big" or \
            status != "reset" and not 400 <= status < 500:
          accepted.append((kind, status, body[:200]))

  workers = [threading.Thread(target=send, args=(requests[i::threads],))
             for i in range(threads)]
  for w in workers:
    w.start()
  for w in workers:
    w.join(timeout=120)
  return {"statuses": statuses, "not_refused": accepted}


@pytest.fixture
def server():
  lines = []
  server = HeartbeatServer(token=TOKEN, say=lines.append)
  server.clear(num_ranks=2)
  server.lines = lines
  yield server
  server.close()


def test_the_issue_cases_are_4xx_with_a_log_line_and_the_server_goes_on(server):
  # The two POSTs that ended a 2-process job: a rank out of range, a failure that is no dict.
  assert request(server.url, body=json.dumps(good_beat(99)).encode()) == 400
  assert request(server.url, body=json.dumps(good_beat(1, failure="notadict")).encode()) == 400
  assert request(server.url, body=json.dumps(good_beat(1)).encode(), token="guess") == 401
  assert request(server.url, body=json.dumps(good_beat(1)).encode(), token=None) == 401
  assert request(server.url, body=b"x" * (MAX_BODY_BYTES + 1)) in (413, "reset")
  assert request(server.url, method="GET", path="/status", token=None) == 401
  assert server.latest() == {}
  assert any("'rank' must be a rank of the running group (0..1): 99" in l for l in server.lines)
  assert any("'failure' is not" in l for l in server.lines)
  assert server.rejections["401 token"] == 3 and server.rejections["400 rank"] == 1
  # The real client, with the token, still gets through; /status answers with the token.
  client = HeartbeatClient(rank=1, heartbeat_url=server.url, interval_s=60, token=TOKEN)
  client.phase(events.TRAINING)
  client.progress(5, 2.5, 0.9, 0.0)
  client.post()
  assert server.latest()[1][0].step == 5
  status_url = server.url.replace("/heartbeat", "/status")
  parts = urllib.parse.urlsplit(status_url)
  connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
  connection.request("GET", "/status", headers={"Authorization": f"Bearer {TOKEN}"})
  response = connection.getresponse()
  assert response.status == 200 and json.loads(response.read())["1"]["step"] == 5


def test_each_wrong_field_is_refused_naming_that_field(server):
  for field, value in WRONG_TYPES:
    before = server.rejections[f"400 {field}"]
    status = request(server.url, body=json.dumps({**good_beat(1), field: value}).encode())
    assert status == 400 and server.rejections[f"400 {field}"] == before + 1, (field, value)
  assert server.latest() == {} and sum(server.rejections.values()) == len(WRONG_TYPES)


def test_a_client_with_the_wrong_token_is_refused_and_says_so_once(server, caplog):
  client = HeartbeatClient(rank=0, heartbeat_url=server.url, interval_s=60, token="stale")
  with caplog.at_level("WARNING", logger="mscale_jax"):
    client.post()
    client.post()
  assert server.latest() == {} and server.rejections["401 token"] == 2
  assert [r.getMessage() for r in caplog.records] == [
      "the driver refused a heartbeat: 401 missing or wrong token"]


def test_a_worker_with_a_long_log_still_reports_its_failure(server, monkeypatch):
  # The client keeps under the limit by dropping its oldest log lines (a smaller limit here,
  # so that the 20 lines of the tail, 2,000 characters each at most, overflow it).
  monkeypatch.setattr(events, "MAX_HEARTBEAT_BYTES", 24 * 1024)
  client = HeartbeatClient(rank=1, heartbeat_url=server.url, interval_s=60, token=TOKEN)
  client.start()
  try:
    for i in range(30):
      logging.getLogger("mscale_jax").error("XLA said: %d %s", i, "x" * 9000)
    client.failure(events.EXCEPTION, "RuntimeError: " + "y" * 20000, step=4)
  finally:
    client.close(events.FAILED)
  beat, _ = server.latest()[1]
  assert beat.failure["kind"] == events.EXCEPTION and beat.failure["step"] == 4
  assert 0 < len(beat.log_tail) < 20 and beat.log_tail[-1].startswith("ERROR XLA said: 29 x")
  assert len(beat.failure["detail"]) <= 4000
  assert server.rejections == {}


def test_slow_and_lengthless_clients_are_cut_off(server):
  parts = urllib.parse.urlsplit(server.url)
  assert request(server.url, body=None, headers={"Content-Length": "-3"}) == 411
  with socket.create_connection((parts.hostname, parts.port)) as s:   # chunked: no length
    s.sendall(f"POST /heartbeat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
              "Transfer-Encoding: chunked\r\n\r\n".encode())
    assert s.recv(100).startswith(b"HTTP/1.0 411")
  assert request(server.url, body=json.dumps(good_beat(0)).encode()) == 204


def test_a_thousand_hostile_requests_are_all_refused(server):
  result = fuzz(server.url, 1000, seed=0, num_ranks=2)
  assert result["not_refused"] == [], result
  assert server.latest() == {}
  assert sum(server.rejections.values()) >= 1000 - result["statuses"].get("reset", 0)
  assert request(server.url, body=json.dumps(good_beat(0)).encode()) == 204
  assert len(server.lines) < 100   # a flood does not flood the driver's output


@pytest.mark.slow
def test_a_live_driver_shrugs_off_a_fuzz_run_and_finishes_the_job(tmp_path):
  """~1,000 hostile requests while a real 2-process job trains: no restart, every step once."""
  port = free_port()
  url = f"http://127.0.0.1:{port}/heartbeat"
  train = job.TINY_GPT + ["--config.train.steps=40", "--config.train.log_every=1",
                          "--config.train.eval_every=40", "--config.train.checkpoint_every=20",
                          "--config.optimizer.warmup_steps=1"]
  result, sent = {}, {}
  runner = threading.Thread(target=lambda: result.update(run=job.run(
      tmp_path, ["--heartbeat_s=0.5", f"--heartbeat_port={port}", "--hang_timeout_s=60",
                 f"--xla_flags={job.TEST_XLA}", "--nostandby"], train, timeout_s=400,
      env={"MSCALE_HEARTBEAT_TOKEN": TOKEN})))
  runner.start()
  deadline = time.time() + 300
  while runner.is_alive() and time.time() < deadline and not sent:
    try:
      parts = urllib.parse.urlsplit(url)
      connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
      connection.request("GET", "/status", headers={"Authorization": f"Bearer {TOKEN}"})
      beats = json.loads(connection.getresponse().read())
      connection.close()
    except OSError:
      beats = {}
    if any(b["phase"] == events.TRAINING and b["step"] >= 1 for b in beats.values()):
      sent.update(fuzz(url, 1000, seed=1, num_ranks=2))
    time.sleep(0.2)
  runner.join(timeout=420)
  run = result["run"]
  assert sent, f"the job never reported training:\n{run.tail()}"
  assert sent["not_refused"] == [], sent
  assert not run.timed_out and not run.leftovers, run.tail()
  report = run.report
  assert run.status == 0 and report["completed"], run.tail()
  assert report["restarts"] == 0 and report["failures"] == [], report["failures"]
  assert sum(report["rejected_requests"].values()) >= 1000 - sent["statuses"].get("reset", 0)
  assert "Traceback" not in run.output, run.tail()
  with open(tmp_path / "metrics.jsonl") as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == list(range(1, 41)), steps
