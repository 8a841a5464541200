"""The Python programs the ssh backend runs on a board, each as `python -c SCRIPT ARG...`.

They need only the standard library of the board's Python: the launcher around every spawned
command (LAUNCHER), the board check (CHECK), the import check of the deployed worker (VERIFY),
commands in one round trip (BATCH), file digests (HASHES), unpacking the code archive
(INSTALL), the clock ping-pong (CLOCK), killing a process group (KILL_GROUP) and removing the
run directory (REMOVE_TREE). CHECK, VERIFY, BATCH and HASHES answer with one line of JSON.
"""

# Runs `argv` in a process group of its own (pid == pgid, printed first), and kills that group
# when stdin reaches EOF, which happens when the SSH channel closes.
LAUNCHER = """
import os, signal, subprocess, sys, threading
try:
    os.setsid()
except OSError:
    pass
print(os.getpid(), flush=True)
try:
    child = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
except OSError as error:
    print(f"{sys.argv[1]}: {error.strerror}", file=sys.stderr)
    sys.exit(127)
def orphaned():
    while os.read(0, 4096):
        pass
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=orphaned, daemon=True).start()
code = child.wait()
os._exit(code if code >= 0 else 128 - code)
"""
CHECK = """
import json, os, platform, subprocess, sys
from importlib import util
def run(*argv):
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
        return [done.returncode, done.stdout.decode(errors="replace").strip()]
    except (OSError, subprocess.SubprocessError) as error:
        return [127, str(error)]
def version(distribution):
    try:
        from importlib import metadata
        return metadata.version(distribution)
    except Exception:
        return ""
def binds(host):
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host, 0), family=family).close()
        return [0, ""]
    except OSError as error:
        return [1, error.strerror or str(error)]
uid = os.getuid()
print(json.dumps({
    "python": platform.python_version(), "executable": sys.executable, "uid": uid,
    "machine": platform.machine(), "kernel": platform.release(),
    "cores": len(os.sched_getaffinity(0)),
    "modules": {m: version(d) for m, d in json.loads(sys.argv[1]).items() if util.find_spec(m)},
    "tc": run("tc", "-V"), "ethtool": run("ethtool", "--version"),
    "addresses": run("ip", "-o", "-4", "addr", "show"),
    "sudo": {tool: run("sudo", "-n", "-l", tool) for tool in ("tc", "ip")} if uid else {},
    "binds": binds(sys.argv[2]) if len(sys.argv) > 2 else None,
}))
"""
VERIFY = """
import importlib, json, sys
found, missing = {}, {}
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
        found[name] = [str(getattr(module, "__version__", "")), module.__file__]
    except Exception as error:
        missing[name] = f"{type(error).__name__}: {error}"
print(json.dumps({"modules": found, "missing": missing}))
"""
BATCH = """
import json, subprocess, sys
results = []
for argv in json.loads(sys.argv[1]):
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        results.append([done.returncode, done.stdout, done.stderr])
    except (OSError, subprocess.SubprocessError) as error:
        results.append([127, "", f"{argv[0]}: {error}"])
print(json.dumps(results))
"""
HASHES = """
import hashlib, json, sys
def digest(path):
    try:
        with open(path, "rb") as stream:
            return hashlib.file_digest(stream, "sha256").hexdigest()
    except OSError:
        return None
print(json.dumps({path: digest(path) for path in sys.argv[1:]}))
"""
INSTALL = """
import os, shutil, sys, tarfile, tempfile
archive, target, digest = sys.argv[1:4]
marker = os.path.join(target, "DIGEST")
if os.path.isdir(target) and not (os.path.isfile(marker) and open(marker).read() == digest):
    shutil.rmtree(target)
staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(target))
with tarfile.open(archive) as tar:
    tar.extractall(staging, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
with open(os.path.join(staging, "DIGEST"), "w") as stream:
    stream.write(digest)
try:
    os.rename(staging, target)
except OSError:  # another run installed the same code meanwhile
    shutil.rmtree(staging)
os.remove(archive)
"""
CLOCK = """
import sys, time
for line in sys.stdin:
    print(repr(time.perf_counter()), flush=True)
"""
KILL_GROUP = """
import os, signal, sys
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except ProcessLookupError:
    pass
"""
REMOVE_TREE = "import shutil, sys; shutil.rmtree(sys.argv[1], ignore_errors=True)"
