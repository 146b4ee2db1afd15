"""Start JupyterLab on notebooks/ the way `make lab` does: as root, headless, on a fixed address.

`make lab` runs this script, and tests/test_lab_server.py runs `make lab` itself, so the command
users run and the one CI checks cannot drift apart.

    python scripts/lab.py [--ip IP] [--port PORT] [--root DIR] [-- EXTRA JUPYTER ARGS...]
"""

from __future__ import annotations

import argparse
import getpass
import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parent.parent


def _address_kind(ip: str) -> str:
    """'loopback', 'wildcard' or 'other'; of the host names, only localhost counts as loopback."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return "loopback" if ip == "localhost" else "other"
    if addr.is_unspecified:
        return "wildcard"
    return "loopback" if addr.is_loopback else "other"


def lab_command(ip: str, port: int, root_dir: Path, extra: list[str], as_root: bool) -> list[str]:
    """The argv that starts JupyterLab; `extra` (LAB_ARGS) is passed through after our flags."""
    return [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",  # headless boxes have none; the URL is printed instead
        f"--ServerApp.ip={ip}",
        f"--ServerApp.port={port}",
        # A busy port must fail, not silently move to another one than the URL printed below.
        "--ServerApp.port_retries=0",
        f"--ServerApp.root_dir={root_dir}",
        # Jupyter refuses to run as root; containers and rented GPU boxes run as root.
        *(["--allow-root"] if as_root else []),
        *extra,
    ]


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    # Everything after `--` goes to Jupyter untouched (LAB_ARGS in the Makefile).
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="make lab", description=__doc__.splitlines()[0])
    parser.add_argument("--ip", default="127.0.0.1", help="listen address, LAB_IP (default: %(default)s)")
    parser.add_argument("--port", default="8888", help="listen port, LAB_PORT (default: %(default)s)")
    parser.add_argument("--root", default=str(REPO / "notebooks"), help="notebook directory (default: notebooks/)")
    return parser.parse_args(own), extra


def _fail(message: str) -> NoReturn:
    """One line on stderr and exit code 2, as for a bad command-line argument."""
    print(f"make lab: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_args(args: argparse.Namespace) -> tuple[str, int, Path]:
    """Fail closed on a bad LAB_IP / LAB_PORT / root before Jupyter prints a page of log about it."""
    ip = args.ip.strip()
    if not ip or any(c.isspace() for c in ip):
        _fail(f"LAB_IP must be one address or host name, got {args.ip!r}")
    try:
        port = int(args.port)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        _fail(f"LAB_PORT must be an integer in 1..65535, got {args.port!r}")
    root_dir = Path(args.root).resolve()
    if not root_dir.is_dir():
        _fail(f"notebook directory {str(root_dir)!r} does not exist")
    try:
        # Same SO_REUSEADDR bind as the server's, so only a live listener fails here.
        socket.create_server((ip, port), family=socket.AF_INET6 if ":" in ip else socket.AF_INET).close()
    except OSError as e:
        _fail(
            f"cannot listen on {ip}:{port} ({e.strerror or e}); "
            f"another server may hold it: try `make lab LAB_PORT={port + 1}`"
        )
    return ip, port, root_dir


def main(argv: list[str] | None = None) -> None:
    args, extra = _parse(sys.argv[1:] if argv is None else argv)
    ip, port, root_dir = _check_args(args)
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    host = f"[{ip}]" if ":" in ip else ip
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container's uid may have no passwd entry
        user = "you"
    machine = socket.gethostname()
    jupyter = Path(sys.executable).parent / "jupyter"
    if jupyter.is_relative_to(Path.cwd()):
        jupyter = jupyter.relative_to(Path.cwd())
    lines = [f"make lab: JupyterLab on {root_dir}, listening on {host}:{port}."]
    if as_root:
        lines.append("make lab: running as root, so --allow-root is passed.")
    lines.append(
        'make lab: once it is up, Jupyter prints the URL to open, with its token, under "copy and paste one '
        f'of these URLs"; `{jupyter} server list` prints it again.'
    )
    kind = _address_kind(ip)
    if kind == "loopback":
        lines.append(
            f"make lab: on a remote machine, first forward the port from your own: "
            f"ssh -N -L {port}:{host}:{port} {user}@{machine}"
        )
    elif kind == "wildcard":
        lines.append(
            f"make lab: LAB_IP={ip} listens on every interface of {machine}: anyone who reaches port {port} "
            f"can try the token. The default LAB_IP=127.0.0.1 with an ssh tunnel is safer."
        )
    print("\n".join(lines), flush=True)
    cmd = lab_command(ip, port, root_dir, extra, as_root)
    # exec, not a child process: the server keeps this PID, so Control-C and kill reach it directly.
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
