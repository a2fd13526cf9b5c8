"""The host's half of verified transfers, run there as `python -I -S -c <this file's text> MODE ARGS...`.

Owns what the host does in the exchange transfers.py holds over one command's stdin and stdout,
one command per file: `receive` writes an upload into `<dest>.part` and hashes it in the same
pass, and renames it onto `dest` only when the sha256 the client computed while sending is the
same; `send` streams a file and hashes it in the same pass. Neither reads the data twice.
Standard library only, Python 3.6 or later: it runs under the host's python with -I -S (no
PYTHON* variables, no site packages, a quick start), and nothing of this project is there.

Protocol: lines are ASCII and end in "\\n"; blank lines from the host are keepalives, sent while
it hashes, so that the client's read timeout measures silence, not work.

  receive PART DEST SIZE LOCK_WAIT_S
    host    "<bytes in PART> <sha256 of DEST if DEST is a file of SIZE bytes, else ->"
    client  end of stdin: DEST already holds these bytes, nothing is changed; or
            "<offset>": keep PART[:offset] (0 <= offset <= bytes in PART, offset <= SIZE)
    host    "ready", once PART[:offset] is read back and hashed
    client  the SIZE - offset bytes from `offset` on, then "<its sha256 of the whole file>"
    host    "ok <sha256>" (PART renamed onto DEST) or "mismatch <sha256>" (PART removed)

  send PATH LOCAL_SIZE
    host    "<size> <sha256 of PATH if size == LOCAL_SIZE, else ->"; exit 3 if PATH is no file
    client  (only after a sha256) "send"; or end of stdin: it has these bytes already
    host    exactly <size> bytes, then "<sha256 of those bytes>"

Risk, and what guards it:
- The digest covers the bytes as they crossed, not a re-read of the file, so nothing else may
  write PART during the exchange: a `receive` whose connection was cut can still be draining
  its pipe into PART when the client reconnects. PART is locked (flock) for the whole exchange;
  a holder that does not let go within LOCK_WAIT_S (a network partition can leave the old sshd
  session waiting on TCP for hours) keeps its file, and this upload unlinks the name and starts
  a new PART from zero. The prefix a resume keeps is read back from PART and hashed, so a
  corrupted or foreign `.part` is caught by the same comparison.
- `send` reads exactly the size it announced: a file cut shorter meanwhile is an error, never a
  short copy that hashes equal on both sides. A file replaced by rename is read whole from the
  open descriptor; one rewritten in place while it is read arrives as the mix that was read, as
  with any copy.
"""

import fcntl
import hashlib
import os
import sys
import time

BLOCK = 1 << 20
KEEPALIVE_S = 10.0
MISSING = 3  # as tasks/hosts/remote/commands.py MISSING: no such file
F_SETPIPE_SZ = 1031  # Linux fcntl; fcntl.F_SETPIPE_SZ only exists from Python 3.10


class Link:
    """This command's stdin and stdout, and when the host last spoke (for keepalives).

    Both are opened here as buffered binary streams whatever the environment says
    (PYTHONUNBUFFERED turns sys.stdout into a raw stream whose writes may be partial), and their
    pipes are widened to BLOCK where Linux allows: sshd then moves more per wakeup.
    """

    def __init__(self):
        self.inp, self.out = os.fdopen(0, "rb", closefd=False), os.fdopen(1, "wb", closefd=False)
        for fd in (0, 1):
            try:
                fcntl.fcntl(fd, F_SETPIPE_SZ, BLOCK)
            except OSError:  # not a pipe, or above /proc/sys/fs/pipe-max-size: the default works too
                pass
        self.last = time.monotonic()

    def say(self, text):
        self.out.write(text.encode("ascii") + b"\n")
        self.out.flush()
        self.last = time.monotonic()

    def keepalive(self):
        if time.monotonic() - self.last >= KEEPALIVE_S:
            self.say("")

    def hear(self):
        """The client's next line, or None when its stdin ended first (the client is done or gone)."""
        line = self.inp.readline()
        return line.decode("ascii").strip() if line.endswith(b"\n") else None


def fail(message, status=1):
    sys.stderr.write(message + "\n")
    sys.exit(status)


def blocks(f, count, buffer):
    """The next `count` bytes of `f` (or up to its end), as views of `buffer` refilled in turn.

    One buffer, reused: a fresh 1 MiB bytes object per read is an mmap and its page faults each time.
    """
    left = count
    while left:
        got = f.readinto(buffer[:min(len(buffer), left)])
        if not got:
            return
        left -= got
        yield buffer[:got]


def hash_from(f, count, link):
    """The sha256 of the next `count` bytes of `f` (fewer at its end), sending keepalives meanwhile."""
    digest = hashlib.sha256()
    for block in blocks(f, count, memoryview(bytearray(BLOCK))):
        digest.update(block)
        link.keepalive()
    return digest


def sha256_if_size(path, size, link):
    """The sha256 of `path` if it is a regular file of `size` bytes, else "-" (then it cannot be equal)."""
    if not os.path.isfile(path) or os.path.getsize(path) != size:
        return "-"
    with open(path, "rb") as f:
        return hash_from(f, size, link).hexdigest()


# -- receive
def try_lock(f, deadline):
    """flock `f`, polling until `deadline`; False if another process still holds it then."""
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        except OSError:  # a filesystem without flock: nothing to wait for there
            return True


def is_still_at(f, path):
    """Whether `path` still names the file `f` has open (a finished `receive` renames or removes it)."""
    try:
        return os.path.samestat(os.fstat(f.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def open_locked(part, lock_wait_s):
    """PART opened read-write (created if absent) and locked; a holder past the wait keeps its file."""
    deadline = time.monotonic() + lock_wait_s
    while True:
        f = os.fdopen(os.open(part, os.O_RDWR | os.O_CREAT, 0o644), "r+b")
        locked = try_lock(f, deadline)
        if locked and is_still_at(f, part):
            return f
        f.close()
        if not locked:
            sys.stderr.write(f"{part} is still held by another writer after {lock_wait_s:.0f} s; "
                             f"starting a new one\n")
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass


def copy_hashing(inp, f, count, digest):
    """Up to `count` bytes from `inp` into `f` and `digest`; the number copied (fewer: stdin ended)."""
    copied = 0
    for block in blocks(inp, count, memoryview(bytearray(BLOCK))):
        digest.update(block)
        f.write(block)
        copied += len(block)
    return copied


def keep_prefix(f, answer, have, size, link):
    """The sha256 of PART[:offset], the resume point the client answered; PART is cut there."""
    offset = int(answer)
    if not 0 <= offset <= min(have, size):
        fail(f"cannot keep {offset} bytes of a .part of {have} for a file of {size}")
    digest = hash_from(f, offset, link)
    f.truncate(offset)  # bytes past the resume point belong to some other attempt
    f.seek(offset)
    return digest, offset


def commit(f, part, dest, got, want, link):
    """PART renamed onto DEST if the client's sha256 `want` is the host's `got`, else removed; say which."""
    if got != want:
        os.unlink(part)
        link.say(f"mismatch {got}")
        return
    f.flush()  # before the rename: DEST is complete the moment it exists
    os.replace(part, dest)
    link.say(f"ok {got}")


def receive(part, dest, size, lock_wait_s):
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    link = Link()
    with open_locked(part, lock_wait_s) as f:
        have = os.fstat(f.fileno()).st_size
        link.say(f"{have} {sha256_if_size(dest, size, link)}")
        answer = link.hear()
        if answer is None:  # the client compared and skips: leave no empty `.part` behind
            if have == 0:
                os.unlink(part)
            return 0
        digest, offset = keep_prefix(f, answer, have, size, link)
        link.say("ready")
        received = copy_hashing(link.inp, f, size - offset, digest)
        want = link.hear() if received == size - offset else None
        if want is None:  # kept: the next attempt resumes from what arrived
            fail(f"{part}: the client stopped after {offset + received} of {size} bytes")
        commit(f, part, dest, digest.hexdigest(), want, link)
    return 0


# -- send
def open_to_send(path):
    try:
        f = open(path, "rb")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        fail(f"{path}: no such file", MISSING)
    if not os.path.isfile(path):
        f.close()
        fail(f"{path}: not a regular file", MISSING)
    return f


def stream_hashing(f, size, link, path):
    """Exactly `size` bytes of `f` onto stdout, hashed on the way; their sha256."""
    digest, sent = hashlib.sha256(), 0
    for block in blocks(f, size, memoryview(bytearray(BLOCK))):
        digest.update(block)
        link.out.write(block)
        sent += len(block)
    if sent != size:
        fail(f"{path} was cut to {sent} bytes while it was sent ({size} announced)")
    return digest.hexdigest()


def send(path, local_size):
    link = Link()
    with open_to_send(path) as f:
        size = os.fstat(f.fileno()).st_size
        known = hash_from(f, size, link).hexdigest() if size == local_size else "-"
        link.say(f"{size} {known}")
        if known != "-":
            if link.hear() != "send":
                return 0
            f.seek(0)
        link.say(stream_hashing(f, size, link, path))
    return 0


def main(argv):
    if argv[:1] == ["receive"] and len(argv) == 5:
        return receive(argv[1], argv[2], int(argv[3]), float(argv[4]))
    if argv[:1] == ["send"] and len(argv) == 3:
        return send(argv[1], int(argv[2]))
    fail(f"usage: receive PART DEST SIZE LOCK_WAIT_S | send PATH LOCAL_SIZE (got {argv})", 2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
