"""A launcher under test: `python ranks_prog.py MODE DIR [TIMEOUT_S]` runs 2 ranks through run_ranks.

Each rank writes DIR/rank<R>.pid once it runs, then, by MODE:
  sleep       loops in Python (ends on the default rank signals)
  stubborn    also treats SIGTERM as a flag only (as the trainer does); rank 1 exits 3 after its
              pid file is written, so only the launcher can end rank 0
  barrier     loops on dist.barrier() (a frozen peer makes it time out)
  stop        steps under StopOnSignal as the trainer does, and returns {"stopped": {"signal": ...}}
              when a signal asks it to (printed as `ranks_prog: stopped by SIGNAL`, exit 0)
Exit status and stderr are the CLI's: one line, 128 + signal after a signal.
"""
import os
import signal
import sys
import time
from pathlib import Path


def _rank(ctx, mode, out):
    Path(out, f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, lambda *_: None)
        if ctx.rank == 1:
            time.sleep(1.0)
            os._exit(3)
    if mode == "stop":
        from megatron_rl.parallel.signals import StopOnSignal

        with StopOnSignal() as stop:
            while not stop.requested():
                time.sleep(0.05)
        return {"stopped": {"signal": signal.Signals(stop.signum).name}}
    while True:
        if mode == "barrier":
            import torch.distributed as dist

            dist.barrier()
        time.sleep(0.05)


def main():
    from megatron_rl.errors import FlexFloorError, Interrupted
    from megatron_rl.parallel.launch import run_ranks

    mode, out = sys.argv[1], sys.argv[2]
    timeout_s = float(sys.argv[3]) if len(sys.argv) > 3 else 60.0
    try:
        result = run_ranks(_rank, 2, mode, out, timeout_s=timeout_s)
    except Interrupted as e:
        print(f"ranks_prog: {e}", file=sys.stderr)
        return 128 + e.signum
    except FlexFloorError as e:
        print(f"ranks_prog: error: {e}", file=sys.stderr)
        return 2
    if result:
        print(f"ranks_prog: stopped by {result['stopped']['signal']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
