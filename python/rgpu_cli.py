"""Console entry points of rgpu.

A top-level module, apart from the ``rgpu`` package, so that the commands start without
importing torch.
"""

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
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
  rgpu-run --host me@gpu-box --check                  (is that server usable from here?)

With --host, rgpu-run asks the host (over ssh) where its rgpu-opserver's Unix socket is
($XDG_RUNTIME_DIR/rgpu/opserver.sock or ~/.rgpu/opserver.sock there), forwards a socket in a
private local directory to it (`ssh -N -L LOCAL.sock:REMOTE.sock HOST`), runs the command with
RGPU_OPSERVER pointing at it, and closes the tunnel afterwards. Only you can open either end,
so no token is needed. With --remote-port, it forwards a local TCP port to the server's TCP
port instead and fetches the server's token over the same ssh (RGPU_TOKEN for the command).
Exit status: the command's; 2 for usage errors; 1 if the tunnel never came up; 127 if the
command is not found."""

# Prints the server's socket on the host, or exits 3 (run by the host's sh).
FIND_SOCKET = ('for s in "${XDG_RUNTIME_DIR:+$XDG_RUNTIME_DIR/rgpu/opserver.sock}" '
               '"$HOME/.rgpu/opserver.sock"; do [ -n "$s" ] && [ -S "$s" ] && '
               '{ echo "$s"; exit 0; }; done; exit 3')
# Prints the server's token on the host (run by the host's sh).
READ_TOKEN = 'cat "${XDG_CONFIG_HOME:-$HOME/.config}/rgpu/token"'


def ssh_base(host, ssh_port=None, identity=None):
    cmd = ["ssh", "-o", "BatchMode=yes"]
    if ssh_port:
        cmd += ["-p", str(ssh_port)]
    if identity:
        cmd += ["-i", identity]
    return cmd


def ssh_command(host, local, remote, ssh_port=None, identity=None):
    """The ssh command line of the tunnel: `local` and `remote` are socket paths, or ports (a
    TCP forward between the two loopback addresses)."""
    if isinstance(local, int):
        local, remote = f"127.0.0.1:{local}", f"127.0.0.1:{remote}"
    return ssh_base(host, ssh_port, identity) + [
        "-N", "-o", "ExitOnForwardFailure=yes", "-o", "StreamLocalBindUnlink=yes",
        "-L", f"{local}:{remote}", host]


def _on_host(args, script):
    """Runs `script` with the host's sh; returns (exit status, stdout, stderr)."""
    cmd = ssh_base(args.host, args.ssh_port, args.identity) + [args.host, script]
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=args.tunnel_timeout)
    return r.returncode, r.stdout.strip(), r.stderr.strip()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_tunnel(proc, local, timeout):
    """Waits until ssh listens on `local` (a socket path, or a port it is probed on)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        if isinstance(local, str):
            if os.path.exists(local):
                return True
        else:
            try:
                with socket.create_connection(("127.0.0.1", local), timeout=0.5):
                    return True
            except OSError:
                pass
        time.sleep(0.1)
    return False


def _tunnel(args):
    """Opens the tunnel of --host. Returns (ssh process, environment for the command, local
    directory to remove), or an error message."""
    env, tmp = {}, None
    if args.remote_port:
        code, token, err = _on_host(args, READ_TOKEN)
        if code != 0 or not token:
            return f"cannot read rgpu-opserver's token on {args.host}" + (f": {err}" if err else "")
        local, remote = _free_port(), args.remote_port
        env = {"RGPU_OPSERVER": f"127.0.0.1:{local}", "RGPU_TOKEN": token}
    else:
        remote = args.remote_socket
        if not remote:
            code, remote, err = _on_host(args, FIND_SOCKET)
            if code == 3:
                return (f"no rgpu-opserver socket on {args.host} (looked for "
                        "$XDG_RUNTIME_DIR/rgpu/opserver.sock and ~/.rgpu/opserver.sock): start "
                        "`rgpu-opserver` there, or give --remote-socket or --remote-port")
            if code != 0 or not remote:
                return f"cannot reach {args.host} with ssh" + (f": {err}" if err else "")
        tmp = tempfile.mkdtemp(prefix="rgpu-run-")  # mode 0700: only this user
        local = os.path.join(tmp, "opserver.sock")
        env = {"RGPU_OPSERVER": f"unix:{local}"}
    cmd = ssh_command(args.host, local, remote, args.ssh_port, args.identity)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if not _wait_for_tunnel(proc, local, args.tunnel_timeout):
        proc.kill()
        err = proc.communicate()[1].strip()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        return f"the tunnel to {args.host} did not come up ({shlex.join(cmd)})" + (
            f": {err}" if err else "")
    return proc, env, tmp


# Run by --check in this Python (which has torch): one JSON line of what it found.
CHECK_CODE = r"""
import json
out = {}
try:
    import torch
    out["client_torch"] = torch.__version__
    import rgpu
    out.update(rgpu._C.server_hello())
    props = torch.rgpu.get_device_properties()
    out["device_name"], out["total_memory"] = props.name, props.total_memory
except ImportError as e:
    out["import_error"] = str(e)
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def check(env, shown) -> int:
    """--check: whether this Python's rgpu can use the server at `shown`, each side's versions,
    the server's device and compiler, and what to do about a problem. Returns 0 if all is well."""
    r = subprocess.run([sys.executable, "-c", CHECK_CODE], env=dict(os.environ, **env),
                       capture_output=True, text=True, timeout=300)
    try:
        found = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        print(f"client: the check could not run in {sys.executable}: {r.stderr.strip()[-800:]}")
        return 1
    if "import_error" in found:
        print(f"client: {sys.executable} cannot import rgpu: {found['import_error']}")
        return 1
    print(f"client: torch {found['client_torch']} ({sys.executable})")
    if "error" in found:
        message = found["error"].split(": ", 1)[-1]
        if message.startswith("rgpu session lost: "):  # a check has no session to lose
            message = message.removeprefix("rgpu session lost: ").rstrip(".")
        print(f"server: {shown}: {message}")
        if "version mismatch" in message:
            print("fix: install the same torch release and the same rgpu on both sides, then "
                  "restart rgpu-opserver")
        return 1
    gib = found["total_memory"] / 2**30
    devices = found.get("devices") or [found["device"]]
    where = (f"device {devices[0]}" if len(devices) == 1 else
             f"devices rgpu:0..{len(devices) - 1} = {','.join(devices)}")
    print(f"server: {shown}: rgpu protocol {found['protocol']}, torch {found['torch']}, {where} "
          f"({found['device_name']}, {gib:.1f} GiB), compiler {found['compiler']}")
    print("ok: this client can use that server")
    return 0


def run(argv=None) -> int:
    """``rgpu-run``: the entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    command = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="rgpu-run", description=RUN_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--host", help="[user@]HOST running rgpu-opserver, reached with ssh")
    where.add_argument("--server", help="unix:PATH or HOST:PORT of an rgpu-opserver reachable "
                       "directly (over TCP, set RGPU_TOKEN or have its token file)")
    p.add_argument("--ssh-port", type=int, help="ssh port on the host")
    p.add_argument("-i", dest="identity", help="ssh identity file")
    p.add_argument("--remote-socket", help="rgpu-opserver's socket on the host (default: found)")
    p.add_argument("--remote-port", type=int,
                   help="reach rgpu-opserver's TCP port instead of its socket (with its token)")
    p.add_argument("--tunnel-timeout", type=float, default=20, help="seconds to wait for the tunnel")
    p.add_argument("--check", action="store_true",
                   help="run no command: tell whether the server (--host, --server, else "
                   "RGPU_OPSERVER or the default socket) can be used, with each side's torch "
                   "and protocol versions and the server's device and compiler, and what to do "
                   "about a problem (exit status 0 if all is well, else 1)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the program to run, after -- or after the last option")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    command = command or args.command
    if not args.check and not (args.host or args.server):
        p.print_usage(sys.stderr)
        print("rgpu-run: one of --host and --server is required (or --check)", file=sys.stderr)
        return 2
    if not command and not args.check:
        p.print_usage(sys.stderr)
        print("rgpu-run: no command given (put it after --)", file=sys.stderr)
        return 2

    tunnel, tmp = None, None
    if args.host:
        try:
            opened = _tunnel(args)
        except subprocess.TimeoutExpired:
            opened = f"ssh to {args.host} did not answer within {args.tunnel_timeout:g} s"
        if isinstance(opened, str):
            print(f"rgpu-run: {opened}", file=sys.stderr)
            return 1
        tunnel, env, tmp = opened
    else:
        env = {"RGPU_OPSERVER": args.server} if args.server else {}
    try:
        if args.check:
            shown = args.host or args.server or os.environ.get("RGPU_OPSERVER") or "the default socket"
            return check(env, shown)
        child = subprocess.run(command, env=dict(os.environ, **env))
        return child.returncode
    except FileNotFoundError:
        print(f"rgpu-run: {command[0]}: command not found", file=sys.stderr)
        return 127
    finally:
        if tunnel:
            tunnel.terminate()
            tunnel.wait()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def run_main() -> None:
    sys.exit(run())
