"""The program that runs inside the sandbox and executes model-written code; it is the only code there that
the harness trusts, and it reports success as a positive signal.

Protocol: the harness writes one JSON object to the runner's stdin (the program's parts, a random token, the
number of the descriptor the token goes back on) and closes it. The runner reads it, points stdin at
/dev/null, compiles and executes the parts in order in one namespace (so a part cannot swallow the next one
into a string literal), and only after the last part returns does it write the token to the result
descriptor and leave with os._exit(0), skipping every atexit handler and excepthook the program installed.
Any other way out (sys.exit, os._exit, exit(), SystemExit, a signal) never writes the token, so it can never
read as a pass: an exit code or printed text is not evidence. The functions the runner needs afterwards are
bound before the program runs, so a program that rebinds `os.write` or `os._exit` cannot redirect them.

What this does not stop: a program written to game its own tests from inside the interpreter that runs them.
The token lives in this process, so a few deliberate lines find it (a walk up `sys._getframe()` to the runner's
frame; measurements/2026-12-01/session7/bar-issue13.json, `forgeries_passed`), just as an answer whose `__eq__`
always returns True passes HumanEval's `assert candidate(...) == ...` without any harness involved. No in-process
harness can exclude this: whatever code reports success, the program can call. It is not something an exit, a
print or a crash does by accident, and the kernel layers still contain such a program (no file, socket or
process outside is reachable).
"""

RUNNER = r"""
import json, os, resource, sys, traceback
def _main():
    _write, _exit, _print_exc = os.write, os._exit, traceback.print_exc
    data = b""
    while True:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        data += chunk
    spec = json.loads(data)
    del data
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    token, fd = spec.pop("token").encode(), spec.pop("fd")
    if spec["nproc"]:  # a hard limit the program cannot raise (it holds no capabilities)
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    try:
        codes = [compile(part, f"<part {i}>", "exec") for i, part in enumerate(spec.pop("parts"))]
    except BaseException:
        _print_exc()
        _exit(101)
    if spec["audit_hook"]:
        _install_hook(os.getcwd())
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        for code in codes:
            exec(code, namespace)
    except Exception:
        try:
            _flush()
            _print_exc()
        finally:
            _exit(101)
    except BaseException as e:  # SystemExit, KeyboardInterrupt: the tests did not complete
        try:
            _flush()
            _write(2, f"\nexited before the tests ran: {type(e).__name__}\n".encode())
        finally:
            _exit(3)
    try:
        _flush()
        _write(fd, token)
    finally:
        _exit(0)

def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass

def _install_hook(root):
    # an extra layer only: it turns the commonest violations into clean Python errors. The kernel layers do
    # not depend on it (it can be bypassed from inside, e.g. through _posixsubprocess).
    blocked = ("socket.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
               "subprocess.Popen", "os.kill", "os.killpg", "ctypes.", "pty.", "os.setsid")
    checked = {"os.remove": 1, "os.rmdir": 1, "os.rename": 2, "os.replace": 2, "os.link": 2, "os.symlink": 2,
               "os.chmod": 1, "os.chown": 1, "os.truncate": 1, "os.mkdir": 1, "os.utime": 1, "shutil.rmtree": 1,
               "os.chdir": 1}
    realpath, fspath, isinstance_, str_, bytes_ = os.path.realpath, os.fspath, isinstance, str, bytes
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    def inside(path):
        if isinstance_(path, int):
            return True
        p = realpath(fspath(path))
        if isinstance_(p, bytes_):
            p = p.decode(errors="replace")
        return p == root or p.startswith(root + "/") or p == "/dev/null"
    def hook(event, args):
        if event.startswith(blocked) or (event == "import" and args[0] in ("ctypes", "_ctypes")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance_(mode, str_) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance_(flags, int) and flags & write_flags)
            name = path if isinstance_(path, (str_, bytes_)) else ""
            if isinstance_(name, bytes_):
                name = name.decode(errors="replace")
            if (writing and not inside(path)) or (name.startswith("/proc/") and not name.startswith("/proc/self/")):
                raise PermissionError(f"sandbox: opening {name!r} is not allowed")
        elif event in checked:
            for p in args[:checked[event]]:
                if p is not None and not inside(p):
                    raise PermissionError(f"sandbox: {event} outside the working folder is not allowed")
    sys.addaudithook(hook)

_main()
"""

FAILED = 101  # the runner's exit status when the program raised (a traceback is on stderr)
EXITED = 3  # the runner's exit status when the program raised SystemExit (or similar) before finishing
