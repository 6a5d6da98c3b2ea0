"""Faults of the operating system on one process, from outside it (for the real-run evaluation).

Each acts on a running worker by its process id and shares nothing with the detectors: the
detectors read counters the kernel keeps (run-queue wait, page faults, CPU time); the faults
change what the kernel does to the process.

  hog       a busy process in a session of its own (another user's job) at a higher priority
            (nice -10; with autogroups, which share CPU between sessions first, the session's
            nice), pinned with the victim to one core. At equal priority it took nothing from
            the victim in our runs: with autogroups the job's session gets the victim's core as
            a whole when the victim is alone on it there, and 3 workers already share 2 cores;
  throttle  SIGSTOP for 0.5 s of every second (the OS taking the whole process away, in
            whatever phase it is);
  mem       memory pressure: every 0.5 s the kernel is asked to reclaim the victim's anonymous
            memory (process_madvise(MADV_PAGEOUT), Linux >= 5.10, root), which goes to a
            compressed swap device (zram) that `swap_on` enables for the run; the victim faults
            its pages back in (major faults) and its resident memory shrinks, as under a
            memory-hungry neighbour. Memory cgroups could not do this here: a running process's
            pages stay charged to its old group (move_charge_at_immigrate is a no-op on this
            kernel), and without swap the kernel cannot reclaim anonymous memory at all.
"""
import ctypes
import os
import signal
import subprocess
import sys
import time

from mscale_jax.resilience.driver.injector import pin_process

MADV_PAGEOUT = 21
_SYS_PROCESS_MADVISE = 440          # x86_64 and aarch64 alike
_ZRAM = "/dev/zram0"


def hog(victim: int, seconds: float, core: int | None = None, busy: int = 1,
        nice: int = -10) -> dict:
  """Pins `victim` and `busy` busy processes (each in its own session, at `nice`) to one core
  (default: the victim's first) for `seconds`, then undoes it."""
  before = os.sched_getaffinity(victim)
  core = sorted(before)[0] if core is None else core
  procs = []
  try:
    for _ in range(busy):
      procs.append(subprocess.Popen([sys.executable, "-c", "while True:\n  pass\n"],
                                    start_new_session=True))
      os.sched_setaffinity(procs[-1].pid, {core})
      _raise_priority(procs[-1].pid, nice)
    pin_process(victim, {core})
    time.sleep(seconds)
  finally:
    for p in procs:
      p.kill()
      p.wait()
    pin_process(victim, before)
  return {"core": core, "busy": busy, "nice": nice}


def _raise_priority(pid: int, nice: int) -> None:
  """`nice` for the process and, where autogroups are on, for its session's group."""
  os.setpriority(os.PRIO_PROCESS, pid, nice)
  try:
    with open(f"/proc/{pid}/autogroup", "w") as f:
      f.write(str(nice))
  except OSError:
    pass


def throttle(victim: int, seconds: float) -> dict:
  """SIGSTOPs `victim` half of every second for `seconds` (always leaving it continued)."""
  end = time.time() + seconds
  try:
    while time.time() < end:
      os.kill(victim, signal.SIGSTOP)
      time.sleep(0.5)
      os.kill(victim, signal.SIGCONT)
      time.sleep(0.5)
  finally:
    os.kill(victim, signal.SIGCONT)
  return {}


class _Iovec(ctypes.Structure):
  _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _anonymous_ranges(pid: int) -> list[tuple[int, int]]:
  out = []
  with open(f"/proc/{pid}/maps") as f:
    for line in f:
      parts = line.split()
      private_rw = parts[1].startswith("rw") and parts[1][3] == "p"
      if private_rw and (len(parts) == 5 or parts[5] == "[heap]"):
        start, end = (int(x, 16) for x in parts[0].split("-"))
        out.append((start, end - start))
  return out


def page_out(pid: int) -> int:
  """Asks the kernel to reclaim `pid`'s private anonymous memory now; returns the bytes it
  went over (the kernel skips pages it cannot reclaim)."""
  libc = ctypes.CDLL(None, use_errno=True)
  fd = os.pidfd_open(pid)
  done = 0
  try:
    ranges = _anonymous_ranges(pid)
    for i in range(0, len(ranges), 512):             # UIO_MAXIOV is 1024
      chunk = ranges[i:i + 512]
      iov = (_Iovec * len(chunk))(*[_Iovec(a, n) for a, n in chunk])
      r = libc.syscall(_SYS_PROCESS_MADVISE, fd, iov, len(chunk), MADV_PAGEOUT, 0)
      if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"process_madvise: {os.strerror(err)}")
      done += r
  finally:
    os.close(fd)
  return done


def mem(victim: int, seconds: float, every_s: float = 0.5) -> dict:
  """Reclaims `victim`'s anonymous memory every `every_s` for `seconds`."""
  end, paged = time.time() + seconds, []
  while time.time() < end:
    paged.append(page_out(victim))
    time.sleep(every_s)
  return {"paged_mb_mean": sum(paged) / max(len(paged), 1) / 2**20}


FAULTS = {"hog": hog, "throttle": throttle, "mem": mem}


def swap_on(size_mb: int = 2048) -> bool:
  """Enables a compressed-RAM swap device (zram) for `mem`; False if one is already on (left
  alone) — raises where there is no zram device or no root."""
  with open("/proc/swaps") as f:
    if _ZRAM in f.read():
      return False
  with open("/sys/block/zram0/disksize", "w") as f:
    f.write(f"{size_mb}M")
  subprocess.run(["mkswap", _ZRAM], check=True, capture_output=True)
  subprocess.run(["swapon", _ZRAM], check=True, capture_output=True)
  return True


def swap_off() -> None:
  """Undoes `swap_on` (pages on it come back to memory first)."""
  subprocess.run(["swapoff", _ZRAM], capture_output=True)
  with open("/sys/block/zram0/reset", "w") as f:
    f.write("1")
