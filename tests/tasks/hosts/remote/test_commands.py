"""tasks/hosts/remote/commands.py through both executors: argv, env and cwd reach the program literally,
exit statuses and output tails, timeouts that kill the whole process group, masked secrets.

"Nothing left running" is checked with `ps`.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

from tasks.hosts.remote import CommandFailed, CommandTimeout, shell_command
from tests.tasks.hosts.remote.helpers import PY, live_processes

ECHO_ARGV = "import json, sys; print(json.dumps(sys.argv[1:]))"
HOSTILE = ["x; touch pwned", "$(touch pwned)", "`touch pwned`", "a'b\"c", "line1\nline2", "$HOME", "*", " spaced ", "",
           "--flag=1 && touch pwned", "| touch pwned", "\\"]


# --------------------------------------------------------------------------- commands


def test_hostile_arguments_reach_the_program_literally(executor, tmp_path):
    result = executor.run([PY, "-c", ECHO_ARGV, *HOSTILE], cwd=str(tmp_path))
    assert json.loads(result.stdout) == HOSTILE
    assert not any(os.path.exists(os.path.join(d, "pwned")) for d in (tmp_path, ".", os.path.expanduser("~")))


def test_hostile_env_value_and_cwd_are_literal(executor, tmp_path):
    workdir = tmp_path / "d; touch pwned $(id)"
    workdir.mkdir()
    result = executor.run([PY, "-c", "import os; print(os.getcwd()); print(os.environ['ODD'])"],
                          env={"ODD": "$(touch pwned); `id` 'q'"}, cwd=str(workdir))
    assert result.stdout.splitlines() == [str(workdir), "$(touch pwned); `id` 'q'"]
    assert list(tmp_path.iterdir()) == [workdir] and list(workdir.iterdir()) == []


def test_bad_env_name_is_refused_before_running(executor):
    with pytest.raises(ValueError, match="env: 'A;B'"):
        executor.run(["true"], env={"A;B": "1"})


def test_exit_status_and_stderr_tail(executor):
    script = "import sys\nfor i in range(30): print(f'err{i}', file=sys.stderr)\nprint('out')\nsys.exit(3)"
    result = executor.run([PY, "-c", script], check=False)
    assert result.exit_status == 3 and result.stdout == "out\n" and "err29" in result.stderr
    with pytest.raises(CommandFailed) as caught:
        executor.run([PY, "-c", script])
    err = caught.value
    assert err.exit_status == 3 and err.argv[0] == PY
    assert err.stderr_tail.splitlines() == [f"err{i}" for i in range(10, 30)]
    assert "exit status 3" in str(err) and "err29" in str(err) and "err9\n" not in str(err)


def test_a_failed_command_is_not_retried(executor, tmp_path):
    counter = tmp_path / "runs"
    with pytest.raises(CommandFailed):
        executor.run(["sh", "-c", 'echo run >> "$1"; exit 1', "sh", str(counter)])
    assert counter.read_text() == "run\n"


def test_timeout_kills_the_command_and_its_children(executor):
    # The shell, its background child and its foreground child must all be gone.
    with pytest.raises(CommandTimeout, match="timed out after 1"):
        executor.run(["sh", "-c", "sleep 3031 & sleep 3032; wait"], timeout=1)
    assert live_processes("sleep 303") == []


def test_env_cwd_and_stdin(executor, tmp_path):
    result = executor.run(["sh", "-c", 'pwd; echo "$GREETING"; cat'], env={"GREETING": "hi there"}, cwd=str(tmp_path),
                          stdin=b"from stdin\n")
    assert result.stdout == f"{tmp_path}\nhi there\nfrom stdin\n"


def test_secret_env_values_are_masked_in_logs(executor, caplog):
    caplog.set_level(logging.DEBUG, logger="eagleops.remote")
    result = executor.run(["sh", "-c", 'echo "${HF_TOKEN#s3}" "$PLAIN"'],
                          env={"HF_TOKEN": "s3cr3t-value", "PLAIN": "visible"})
    assert result.stdout == "cr3t-value visible\n"  # the program got the real value
    logged = caplog.text
    assert "s3cr3t-value" not in logged and "HF_TOKEN=****" in logged and "PLAIN=visible" in logged


def test_output_is_logged_while_the_command_runs(executor, tmp_path):
    # The command waits for a file the log handler creates when it sees "ready": if output were
    # only logged at the end, the command would never finish and would time out.
    go = tmp_path / "go"

    class Opener(logging.Handler):
        def emit(self, record):
            if record.getMessage().endswith("] ready"):
                go.touch()

    handler = Opener()
    remote_logger = logging.getLogger("eagleops.remote")
    remote_logger.addHandler(handler)
    remote_logger.setLevel(logging.INFO)
    try:
        script = f"import os, time\nprint('ready', flush=True)\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
        executor.run([PY, "-c", script], timeout=60)
    finally:
        remote_logger.removeHandler(handler)
    assert go.exists()


def test_shell_command_shape():
    line = shell_command(["echo", "a b"], env={"K": "v w"}, cwd="~/work dir", timeout=2)
    assert line == "cd \"$HOME\"/'work dir' && timeout -k 5 2.000 env 'K=v w' echo 'a b'"
