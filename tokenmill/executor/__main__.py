"""`python -m tokenmill.executor`: one worker rank, its `WorkerArgs` pickled on stdin (started by
executor/multiproc.py: WorkerProcess)."""

import logging
import pickle
import sys

from tokenmill.executor.worker import worker_main

args = pickle.load(sys.stdin.buffer)
logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s")
worker_main(args)
