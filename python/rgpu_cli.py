"""Console entry points of rgpu.

A top-level module, apart from the ``rgpu`` package, so that the commands start without
importing torch.
"""

import argparse
import os
import shlex
import socket
import subprocess
import sys
import time


def _native(name):
    binary = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rgpu", "bin", name)
    if not os.path.exists(binary):
        sys.exit(f"{name}: the native program is not built; run `make` in the rgpu checkout")
    os.execv(binary, [binary] + sys.argv[1:])


def opserver() -> None:
    """``rgpu-opserver``: runs the native server shipped inside the package. Its Inductor compiles
    run in this Python, which has torch."""
    os.environ.setdefault("RGPU_PYTHON", sys.executable)
    _native("rgpu-opserver")


def trace_dump() -> None:
    """``rgpu-trace-dump``: lists, shows and diffs cached graphs (native, no torch)."""
    _native("rgpu-trace-dump")


RUN_HELP = """Runs a program against an rgpu-opserver, through an ssh tunnel to the GPU host.

examples:
  rgpu-run --host me@gpu-box -- python train.py
  rgpu-run --server 127.0.0.1:9720 -- python train.py
  rgpu-run --server 127.0.0.1:9720 python train.py     (the -- is optional)

With --host, opens `ssh -N -L PORT:127.0.0.1:REMOTE_PORT HOST`, waits until the tunnel accepts,
runs the command with RGPU_OPSERVER pointing at it, and closes the tunnel afterwards.
Exit status: the command's; 2 for usage errors; 1 if the tunnel never came up; 127 if the
command is not found."""


def ssh_command(host, local_port, remote_port=9720, ssh_port=None, identity=None):
    """The ssh command line that forwards local_port to the server's loopback port."""
    cmd = ["ssh", "-N", "-o", "ExitOnForwardFailure=yes", "-o", "BatchMode=yes",
           "-L", f"127.0.0.1:{local_port}:127.0.0.1:{remote_port}"]
    if ssh_port:
        cmd += ["-p", str(ssh_port)]
    if identity:
        cmd += ["-i", identity]
    return cmd + [host]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_tunnel(proc, port, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def run(argv=None) -> int:
    """``rgpu-run``: the entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    command = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="rgpu-run", description=RUN_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--host", help="[user@]HOST running rgpu-opserver, reached with ssh")
    where.add_argument("--server", help="HOST:PORT of an rgpu-opserver reachable directly")
    p.add_argument("--ssh-port", type=int, help="ssh port on the host")
    p.add_argument("-i", dest="identity", help="ssh identity file")
    p.add_argument("--remote-port", type=int, default=9720, help="rgpu-opserver's port (default 9720)")
    p.add_argument("--tunnel-timeout", type=float, default=20, help="seconds to wait for the tunnel")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the program to run, after -- or after the last option")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    command = command or args.command
    if not command:
        p.print_usage(sys.stderr)
        print("rgpu-run: no command given (put it after --)", file=sys.stderr)
        return 2

    tunnel = None
    if args.host:
        port = _free_port()
        cmd = ssh_command(args.host, port, args.remote_port, args.ssh_port, args.identity)
        tunnel = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if not _wait_for_tunnel(tunnel, port, args.tunnel_timeout):
            tunnel.kill()
            err = tunnel.communicate()[1].strip()
            print(f"rgpu-run: the tunnel to {args.host} did not come up ({shlex.join(cmd)})"
                  + (f": {err}" if err else ""), file=sys.stderr)
            return 1
        address = f"127.0.0.1:{port}"
    else:
        address = args.server
    try:
        child = subprocess.run(command, env=dict(os.environ, RGPU_OPSERVER=address))
        return child.returncode
    except FileNotFoundError:
        print(f"rgpu-run: {command[0]}: command not found", file=sys.stderr)
        return 127
    finally:
        if tunnel:
            tunnel.terminate()
            tunnel.wait()


def run_main() -> None:
    sys.exit(run())
