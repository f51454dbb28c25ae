"""What the torch loader's forkserver imports before it forks a worker (rectrain.loaders.pytorch.worker_context).
Imported by that process alone, never by a rank: importing it ignores signals.

- The loader module, so torch, torchvision's transforms and the decoders are imported once per rank,
  not once per worker and epoch.
- The rank's stop signals ignored (RANK_SIGNALS), which the workers it forks inherit.  The forkserver
  starts in its rank's process group, so Ctrl-C there or a SIGTERM to the group reaches it too; it must
  outlive the signal, for torch's watchdog in each worker ends the worker when its parent - this
  process - goes, and the rank still needs batches to finish its step and checkpoint.  It ends when its
  rank and workers are gone (multiprocessing's alive pipe), and the workers end with their rank
  (rectrain.loaders.pytorch.end_with).
"""

import signal

from rectrain.loaders.pytorch import RANK_SIGNALS

for _name in RANK_SIGNALS:
    signal.signal(getattr(signal, _name), signal.SIG_IGN)
