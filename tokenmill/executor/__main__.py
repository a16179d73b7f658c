"""`python -m tokenmill.executor PARENT_PID [--pdeathsig]`: one worker rank, started by
executor/multiproc.py (WorkerProcess). It ties itself to its parent first (lifeline.py: its
`WorkerArgs` arrive pickled on stdin, which then stays open), and only then imports torch."""

import contextlib
import logging
import os
import pickle
import sys
import traceback

from tokenmill.executor.lifeline import attach, exit_orphaned

parent_pid = int(sys.argv[1])
payload = attach(parent_pid, pdeathsig="--pdeathsig" in sys.argv[2:])

from tokenmill.executor.worker import worker_main  # noqa: E402 - after the tie to the parent, on purpose

args = pickle.loads(payload)
logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s")
code = 0
try:
    worker_main(args)
except BaseException as e:  # noqa: BLE001 - reported here, and the process ends below
    if os.getppid() != parent_pid:  # what broke is that the engine's process is gone
        exit_orphaned()
    with contextlib.suppress(OSError):
        traceback.print_exc()
    code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
# Out without the interpreter's teardown, which takes a second or more with torch loaded (and
# during which the lifeline's thread cannot run): worker_main has left the process group.
with contextlib.suppress(OSError):
    sys.stdout.flush()
    sys.stderr.flush()
os._exit(code)
