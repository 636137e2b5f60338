"""A fork server for the rehearsal of a prepared run (gpu_check.sh --rehearse): torch, transformers'
Llama and superoffload_hf are imported once, and each stage's `python3 ...` forks from there
instead of importing them again (seconds of CPU per stage on a shared 2-core machine). The GPU
run does not use it: there every stage is a fresh `python3`.

    python3 benchmarks/_pyfork.py serve SOCKET          # imports, then serves until killed
    python3 benchmarks/_pyfork.py run SOCKET ARGS...    # as `python3 ARGS...`: script, -m module, -c code

`run` hands the server its argv, working directory, environment and standard streams; the server
forks a child that runs them in a session of its own and returns the child's exit status. A TERM
or INT to `run` (`timeout` ending the stage) kills the child's session, so nothing outlives the
stage. `run` is light: it imports no torch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time

CONNECT_SECONDS = 300  # how long `run` waits for the server to finish its imports


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the requested `python3 ARGS...`, then exit with its status."""
    import runpy

    os.setsid()
    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    args, code = request["argv"], 0
    try:
        if args[:1] == ["-c"]:
            sys.argv, sys.path[0] = ["-c", *args[2:]], ""
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        elif args[:1] == ["-m"]:
            sys.argv, sys.path[0] = [args[1], *args[2:]], os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = list(args), os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # as python3 would: the traceback, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _wait(conn: socket.socket, pid: int) -> None:
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    conn.sendall(f"{code if code >= 0 else 128 - code}\n".encode())  # killed by a signal: as a shell says
    conn.close()


def serve(path: str) -> None:
    import torch  # noqa: F401  (what every stage imports: the point of the server)
    import transformers.models.llama.modeling_llama  # noqa: F401

    import superoffload_hf  # noqa: F401
    import superoffload_hf.testing.sim  # noqa: F401

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".part")
    os.rename(path + ".part", path)  # it appears once it accepts
    server.listen(8)
    while True:
        conn, _ = server.accept()
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        pid = os.fork()  # on the main thread: the other threads only wait for their children
        if pid == 0:
            server.close()
            conn.close()
            _child(json.loads(data), fds)
        for fd in fds:
            os.close(fd)
        threading.Thread(target=_wait, args=(conn, pid), daemon=True).start()


def run(path: str, args: list[str]) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        try:
            conn.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                print(f"_pyfork: no server at {path} after {CONNECT_SECONDS} s", file=sys.stderr)
                return 1
            time.sleep(0.05)
    request = {"argv": args, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    reader = conn.makefile("r")
    pid = int(reader.readline())

    def kill(signum, frame):  # the stage is ended: end the child's session with it
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, kill)
    signal.signal(signal.SIGINT, kill)
    line = reader.readline()
    return int(line) if line.strip() else 1


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "serve":
        serve(argv[1])
        return 0
    if len(argv) >= 3 and argv[0] == "run":
        return run(argv[1], argv[2:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
