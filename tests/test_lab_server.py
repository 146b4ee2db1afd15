"""`make lab` starts a JupyterLab that answers: this runs the Makefile target itself (so the check cannot
drift from what users run), fetches /api/status with the server's token on loopback, then stops the
server by its PID. Everything is bounded so CI can never hang on it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib.util import find_spec, module_from_spec, spec_from_file_location
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
START_S = 120.0  # a cold start takes ~5 s on a 2-core CI box; the bound only keeps a hang from stalling CI
STOP_S = 30.0
# Loopback only, and never through an http_proxy that CI's environment may set.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _lab_module() -> ModuleType:
    """scripts/lab.py is a script, not part of the package: load it from its path."""
    spec = spec_from_file_location("megacpp_lab_script", REPO / "scripts" / "lab.py")
    assert spec is not None and spec.loader is not None
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str, bytes]:
    """(status, content type, body); an HTTP error status is an answer too."""
    try:
        with _OPENER.open(url, timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def _tail(log: Path, n: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.exists() else "(no output)"


def _require_lab() -> None:
    if find_spec("jupyterlab") is None:
        # CI installs the [lab] extra through `make test`, so a missing JupyterLab there is a defect.
        if os.environ.get("CI"):
            pytest.fail("jupyterlab is not installed, but CI must check that `make lab` answers")
        pytest.skip("jupyterlab is not installed (the [lab] extra)")


def _wait_for_server_info(runtime: Path, port: int, proc: subprocess.Popen, log: Path, deadline: float) -> dict:
    """The server writes jpserver-<pid>.json (pid, port, token, root_dir) once it is listening."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"`make lab` exited with {proc.returncode} before the server came up:\n{_tail(log)}")
        for f in runtime.glob("jpserver-*.json"):
            try:
                info = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                continue  # being written
            if info.get("port") == port:
                return info
        time.sleep(0.2)
    pytest.fail(f"no Jupyter server wrote its info file within {START_S:.0f} s:\n{_tail(log)}")


def _wait_for_status(url: str, deadline: float) -> tuple[int, str, bytes]:
    answer: tuple[int, str, bytes] | None = None
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):  # refused until the server accepts
            answer = _get(url)
            if answer[0] == 200:
                return answer
        time.sleep(0.2)
    pytest.fail(f"/api/status did not answer 200 within {START_S:.0f} s; last answer: {answer!r}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_make_lab_answers_on_loopback_and_stops_by_pid(tmp_path: Path) -> None:
    _require_lab()
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    # The Makefile runs $(VENV)/bin/python: point VENV at this interpreter's environment, and mark its
    # install stamp as up to date so the check never bootstraps or reinstalls anything.
    venv = Path(sys.prefix)
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"{venv}/bin/python does not exist, and the Makefile runs $(VENV)/bin/python")
    port = _free_loopback_port()
    runtime = tmp_path / "runtime"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "JUPYTER_TOKEN")}
    env["JUPYTER_RUNTIME_DIR"] = str(runtime)  # our server's info file, apart from any other server's
    log = tmp_path / "lab.log"
    cmd = [make, "--no-print-directory", "-C", str(REPO), "-o", f"{venv}/.megacpp-lab-installed"]
    cmd += [f"VENV={venv}", "lab", "LAB_IP=127.0.0.1", f"LAB_PORT={port}"]
    with log.open("wb") as out:
        # Own session: if the check fails half-way, the finally below can still stop everything it started.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        info = _wait_for_server_info(runtime, port, proc, log, deadline)
        pid, token = int(info["pid"]), info["token"]
        assert token, f"the server runs without a token: {info}"
        assert Path(info["root_dir"]) == REPO / "notebooks", info

        status, ctype, body = _wait_for_status(f"http://127.0.0.1:{port}/api/status?token={token}", deadline)
        assert "json" in ctype, f"/api/status answered {ctype!r}, not JSON: {body[:200]!r}"
        answer = json.loads(body)
        assert {"started", "kernels"} <= answer.keys(), answer
        # Without the token the API must refuse: the server is not open to anyone who reaches the port.
        assert _get(f"http://127.0.0.1:{port}/api/status")[0] == 403

        # The URL a user must open, with its token, is on the terminal.
        url = f"http://127.0.0.1:{port}/lab?token={token}"
        while url not in log.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert url in log.read_text(errors="replace"), f"`make lab` never printed {url}:\n{_tail(log)}"
        if os.geteuid() == 0:
            assert "--allow-root is passed" in log.read_text(), _tail(log)

        os.kill(pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_S)  # make returns once its server has exited
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server (pid {pid}) did not stop within {STOP_S:.0f} s of SIGTERM:\n{_tail(log)}")
        assert not _pid_alive(pid), f"server pid {pid} is still alive after `make lab` returned"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "abc"], "LAB_PORT must be an integer in 1..65535, got 'abc'"),
        (["--port", "0"], "LAB_PORT must be an integer in 1..65535, got '0'"),
        (["--port", "70000"], "LAB_PORT must be an integer in 1..65535, got '70000'"),
        (["--ip", ""], "LAB_IP must be one address or host name, got ''"),
        (["--ip", "1.2.3.4 5.6.7.8"], "LAB_IP must be one address or host name"),
        (["--root", "/nonexistent/notebooks"], "notebook directory '/nonexistent/notebooks' does not exist"),
    ],
)
def test_lab_script_refuses_bad_settings_by_name(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _lab_module().main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(f"make lab: {message}")


def test_lab_script_refuses_a_busy_port_before_starting_jupyter(capsys: pytest.CaptureFixture[str]) -> None:
    lab = _lab_module()
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            lab.main(["--port", str(port)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and f"LAB_PORT={port + 1}" in err, err


def test_lab_command_passes_allow_root_only_as_root_and_user_flags_last() -> None:
    lab = _lab_module()
    root = REPO / "notebooks"
    as_root = lab.lab_command("127.0.0.1", 8888, root, ["--ServerApp.base_url=/x/"], as_root=True)
    as_user = lab.lab_command("127.0.0.1", 8888, root, [], as_root=False)
    assert "--allow-root" in as_root and "--allow-root" not in as_user
    assert "--no-browser" in as_user and "--ServerApp.port_retries=0" in as_user
    assert as_root[-1] == "--ServerApp.base_url=/x/"
